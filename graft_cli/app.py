"""The ``graft`` command line: one typer app; each command group lives in graft_cli/commands/.

User errors (GraftError, and OSErrors about a path such as an output that exists as a file) become one
line on stderr and exit code 2; a Ctrl-C is one line and exit code 130; ``graft --debug ...`` shows
the traceback instead.
"""

from __future__ import annotations

import sys
import warnings

import click
import typer
from typer.core import TyperGroup, TyperOption

from graft_cli.commands import credit, envs, loop, rollout, schema, sql, synth, update, warmstart
from graft_cli.commands.closed_stdout import CLOSED_STDOUT, closed_stdout_exit, stdout_closed
from schemas.errors import GraftError, GraftWarning

# the command groups in the order graft --help lists them
COMMAND_MODULES = (synth, schema, sql, credit, envs, warmstart, rollout, update, loop)


class _GraftGroup(TyperGroup):
    """Turns GraftError into one line + exit 2 (for the real CLI and for CliRunner alike)."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except GraftError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            typer.echo(f"error: {_printable(str(exc))}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except BrokenPipeError:
            # stdout was closed by its reader (``graft sql ... | head -1``): stop quietly, as ``yes`` does
            raise typer.Exit(closed_stdout_exit()) from None
        except SystemExit as exc:
            if _from_broken_pipe(exc):  # rich's console ends with sys.exit(1) when stdout closes
                raise typer.Exit(closed_stdout_exit()) from None
            # graft's own commands end through click's Exit, never SystemExit: this is sys.exit() called
            # by code graft runs (an environment, a plug-in, a model's own code)
            if ctx.obj and ctx.obj.get("debug"):
                raise
            typer.echo(f"error: {_printable(_exit_origin(exc))}", err=True)
            raise typer.Exit(GraftError.exit_code) from None
        except KeyboardInterrupt:
            # Ctrl-C: one line and the shell's code for SIGINT (128 + 2), not click's "Aborted!"
            if ctx.obj and ctx.obj.get("debug"):
                raise
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None
        except OSError as exc:
            # a path the user gave that cannot be written or read (exists as a file, not a directory,
            # no permission, ...): one line like a GraftError; OSErrors without a path stay tracebacks
            if exc.filename is None or (ctx.obj and ctx.obj.get("debug")):
                raise
            typer.echo(f"error: {exc.filename}: {exc.strerror or exc}", err=True)
            raise typer.Exit(GraftError.exit_code) from None

    def list_commands(self, ctx: click.Context) -> list[str]:  # keep registration order in --help
        return list(self.commands)


_display_type_rich = TyperOption.display_type_rich


def _exit_origin(exc: SystemExit) -> str:
    """``FILE:LINE called sys.exit(CODE)``: where the SystemExit was raised (its innermost frame)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "code graft ran"
    return (
        f"{where} called sys.exit({exc.code!r}) inside graft; an environment or plug-in must raise an "
        "exception instead"
    )


def _from_broken_pipe(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while handling a closed stdout (a BrokenPipeError in its context)."""
    seen = exc.__context__
    while seen is not None:
        if isinstance(seen, BrokenPipeError):
            return True
        seen = seen.__context__
    return False


def _printable(message: str) -> str:
    """One line with every control character escaped: a path or key from someone else's run cannot
    send terminal escape sequences (or break the line) through an error message."""
    from graft_cli.commands.printable import printable

    return printable(message)


def _option_type_label(self: TyperOption, ctx: click.Context) -> str | None:
    """No value label for flags: typer shows ``<bool>`` after ``--force`` as if it took a value; a
    repeatable option shows its item type (``--set <str>``, not ``<list[str]>``: it takes one per use)."""
    if self.is_flag:
        return None
    label = _display_type_rich(self, ctx)
    if label and label.startswith("<list[") and label.endswith("]>"):
        return "<" + label[len("<list[") : -2] + ">"
    return label


TyperOption.display_type_rich = _option_type_label  # type: ignore[method-assign]

app = typer.Typer(
    cls=_GraftGroup,
    help="graft: train LLM agents with RL and GRAFT step-level credit assignment.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help: rich's help renderer alone costs ~0.25 s of every cold start (docs/design.md)
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        typer.echo(f"graft {package_version('graft')}")
    except PackageNotFoundError:  # a source tree that was never installed
        typer.echo("graft (not installed)")
    raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for user errors."),
    trust_run: bool = typer.Option(
        False,
        "--trust-run",
        help="Honour settings that run code (model.trust_remote_code, a plug-in env.name) from a saved "
        "run's config.toml; without it they must be repeated with --set.",
    ),
    version: bool = typer.Option(
        False, "--version", help="Print graft's version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    from schemas.trust import trust_saved_runs

    trust_saved_runs(trust_run)
    ctx.obj = {"debug": debug}


for _commands in COMMAND_MODULES:
    _commands.register(app)


def _show_warning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    """GraftWarnings as one ``warning: ...`` line on stderr; other warnings as Python prints them."""
    if issubclass(category, GraftWarning):
        print(f"warning: {message}", file=sys.stderr if file is None else file)
        return
    _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main() -> None:
    """Console entry point. A stdout closed by its reader ends the command quietly with status 141
    (128 + SIGPIPE, as ``yes | head -1``) wherever it is noticed: in a command, in click's own output
    (``--help``: click exits 1 on EPIPE), or when Python flushes stdout at exit."""
    warnings.showwarning = _show_warning
    if sys.stdout is None:
        # started with stdout closed (``graft ... >&-``): Python then has no sys.stdout, and the next
        # file graft opens would take descriptor 1. Refused before the command runs, as coreutils'
        # ``ls >&-`` says "write error: Bad file descriptor"
        print("error: stdout: write error: Bad file descriptor (stdout is closed)", file=sys.stderr)
        sys.exit(GraftError.exit_code)
    try:
        code = app()
    except SystemExit as exc:
        code = exc.code
    if code not in (0, None) and code != CLOSED_STDOUT and stdout_closed():
        code = closed_stdout_exit() if code == 1 else code  # 1: click's EPIPE exit
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = closed_stdout_exit()
    sys.exit(code)
