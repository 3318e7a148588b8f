"""``graft graph|solve|advantage`` on runs and on files, the Python API, and bad input (exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from graft_cli.app import app
from schemas import read_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import create_run
from stages import credit
from stages.credit import runners
from stages.credit.synth import synth_steps
from tests.helpers.credit_cases import fig2_steps
from tests.helpers.reference_graft import reference_advantages, reference_graph, reference_values


def _write_plain(steps: pl.DataFrame, path: Path) -> Path:
    """A steps file as another framework would write it: no graft metadata, int64 steps."""
    steps.with_columns(pl.col("step").cast(pl.Int64), pl.col("iter").cast(pl.Int64)).write_parquet(path)
    return path


def test_files_graph_solve_advantage(runner, tmp_path):
    steps = fig2_steps()
    path = _write_plain(steps, tmp_path / "steps.parquet")
    out = tmp_path / "out"
    result = runner.invoke(app, ["graph", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    nodes = read_table(out / "nodes.parquet", "nodes")
    assert nodes["state"].to_list() == ["S", "L", "G", "D", "F"]
    result = runner.invoke(app, ["solve", str(out), "--set", "solve.gamma=0.9"])
    assert result.exit_code == 0, result.output
    values = read_table(out / "values.parquet", "values")
    assert values["value"][3] == pytest.approx(0.45, abs=1e-7)  # D, see test_solve
    args = ["advantage", str(path), "-o", str(out), "--set", "solve.gamma=0.9", "--set", "advantage.lam=0.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    adv = read_table(out / "advantages.parquet", "advantages")
    graph = reference_graph(steps.to_dicts())
    ref = reference_advantages(graph, reference_values(graph, 0.9), 0.9, 0.5, "graph", "node")  # defaults
    np.testing.assert_allclose(adv["gae"].to_numpy(), ref["gae"], atol=1e-7)
    metrics = pl.concat(
        [read_table(out / f"metrics_{s}.parquet", "metrics") for s in ("graph", "solve", "advantage")]
    )
    names = dict(zip(metrics["name"], metrics["value"], strict=False))
    assert names["nodes"] == 5 and names["edges"] == 12
    # Out-edges per node with out-edges: S 6, L 3, D 3 -> 4; every step's src has >= 2 out-edges.
    assert names["mean_node_group_size"] == 4.0 and names["share_steps_group_ge2"] == 1.0
    assert names["propagation_mean"] == pytest.approx((6 * 6 + 3 * 5 + 3 * 6) / 12)
    assert names["share_steps_propagation_1"] == 0.0


def test_advantage_on_files_computes_missing_stages_with_any_estimator(runner, tmp_path):
    path = _write_plain(synth_steps(groups=2, group_size=4, horizon=5, seed=1), tmp_path / "s.parquet")
    out = tmp_path / "o"
    result = runner.invoke(app, ["advantage", str(path), "-o", str(out), "--set", "advantage.estimator=grpo"])
    assert result.exit_code == 0, result.output
    for name in ("nodes", "edges", "values", "advantages"):
        assert (out / f"{name}.parquet").is_file()
    adv = read_table(out / "advantages.parquet", "advantages")
    assert adv["estimator"].unique().to_list() == ["grpo"] and adv["td"].null_count() == adv.height


def test_advantage_on_files_never_reuses_tables_of_other_inputs(runner, tmp_path):
    """Tables left in -o by an earlier call are reused only for the same steps file and graph/solve config."""
    steps = fig2_steps()
    path = _write_plain(steps, tmp_path / "s.parquet")
    out = tmp_path / "o"

    def advantages(*sets: str) -> np.ndarray:
        args = ["advantage", str(path), "-o", str(out), *(a for s in sets for a in ("--set", s))]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        return read_table(out / "advantages.parquet", "advantages")["advantage"].to_numpy()

    def expected(config: Config, table: pl.DataFrame = steps) -> np.ndarray:
        return credit.run_all(table, config).advantages["advantage"].to_numpy()

    np.testing.assert_allclose(advantages(), expected(Config()), atol=1e-9)
    gamma = Config()
    gamma.solve.gamma = 0.5
    np.testing.assert_allclose(advantages("solve.gamma=0.5"), expected(gamma), atol=1e-9)
    bootstrap = Config()
    bootstrap.graph.truncation = "bootstrap"
    np.testing.assert_allclose(advantages("graph.truncation=bootstrap"), expected(bootstrap), atol=1e-9)
    # another steps file at the same path, same rows and graph shape, other outcomes
    changed = steps.with_columns(pl.col("outcome") * 3.0 + 1.0)
    _write_plain(changed, path)
    np.testing.assert_allclose(advantages(), expected(Config(), changed), atol=1e-9)


def test_config_file_for_files(runner, tmp_path):
    path = _write_plain(fig2_steps(), tmp_path / "s.parquet")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[graph]\ntruncation = "bootstrap"\n[solve]\ngamma = 0.9\n')
    out = tmp_path / "o"
    result = runner.invoke(app, ["advantage", str(path), "-o", str(out), "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    values = read_table(out / "values.parquet", "values")
    assert values["value"][3] == pytest.approx(0.6, abs=1e-7)  # D without T6's cut end


def test_run_mode(runner, tmp_path):
    config = Config()
    config.solve.gamma = 0.9
    run = create_run(tmp_path / "run", config)
    steps = synth_steps(groups=3, group_size=4, horizon=6, seed=3)
    run.write(2, "steps", steps.with_columns(pl.lit(2, dtype=pl.Int32).alias("iter")))
    # advantage on a run runs the missing graph and solve stages first.
    result = runner.invoke(app, ["advantage", str(run.root), "--iter", "2"])
    assert result.exit_code == 0, result.output
    for stage in ("graph", "solve", "advantage"):
        assert run.stage_complete(stage, 2)
        metrics = read_table(run.iter_dir(2) / f"metrics_{stage}.parquet", "metrics")
        assert set(metrics["stage"]) == {stage} and set(metrics["iter"]) == {2}
    tables = credit.run_all(steps, config)
    np.testing.assert_allclose(
        run.read(2, "advantages")["advantage"].to_numpy(),
        tables.advantages["advantage"].to_numpy(),
        atol=1e-9,
    )
    # graph / solve alone, with an override: a finished stage is recomputed only with --force, which
    # removes the advantages computed from the old values
    args = ["solve", str(run.root), "--iter", "2", "--set", "solve.gamma=0.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "use --force" in result.output
    result = runner.invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert not np.allclose(run.read(2, "values")["value"], tables.values["value"])
    assert not run.stage_complete("advantage", 2)
    result = runner.invoke(app, ["graph", str(run.root), "--iter", "2", "--force"])
    assert result.exit_code == 0, result.output
    assert run.read(2, "edges").equals(tables.edges)
    assert not run.stage_complete("solve", 2)
    # advantage with --set solve.gamma: the values it uses are solved at that gamma, not the stored ones
    result = runner.invoke(app, ["advantage", str(run.root), "--iter", "2", "--set", "solve.gamma=0.7"])
    assert result.exit_code == 0, result.output
    config.solve.gamma = 0.7
    np.testing.assert_allclose(
        run.read(2, "advantages")["advantage"].to_numpy(),
        credit.run_all(steps, config).advantages["advantage"].to_numpy(),
        atol=1e-9,
    )


def test_python_api_on_own_rollouts():
    steps = fig2_steps()
    nodes, edges = credit.graph(steps)
    values = credit.solve(nodes, edges, gamma=0.9)
    adv = credit.advantages(steps, nodes, edges, values, gamma=0.9, lam=0.5, gae="none", normalize="none")
    # without GAE and normalization the credit is the TD plus the step's own reward (step_rewards "step")
    expected = adv["td"].to_numpy() + steps["reward"].to_numpy()
    np.testing.assert_allclose(adv["advantage"].to_numpy(), expected)
    assert steps["reward"][7] == -0.1 and adv["advantage"][7] == pytest.approx(adv["td"][7] - 0.1)
    legacy = credit.solve(nodes, edges, gamma=0.9, step_rewards="values")
    old = credit.advantages(
        steps, nodes, edges, legacy, gamma=0.9, step_rewards="values", lam=0.5, gae="none", normalize="none"
    )
    np.testing.assert_allclose(old["advantage"].to_numpy(), old["td"].to_numpy())
    auto = credit.advantages(steps, estimator="rloo")
    assert auto["estimator"][0] == "rloo"
    tables = credit.run_all(steps)
    assert tables.metrics["stage"].unique().sort().to_list() == ["advantage", "graph", "solve"]
    with pytest.raises(GraftError, match="unknown advantage option"):
        credit.advantages(steps, lamda=0.5)


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def _break(rule: str) -> pl.DataFrame:
    s = fig2_steps()
    row = pl.int_range(pl.len()) == 1  # T1 step 1 (its done row)
    if rule == "unique":
        return pl.concat([s, s[1]])
    if rule == "contiguous":
        return s.with_columns(step=pl.when(row).then(5).otherwise(pl.col("step")))
    if rule == "one_done":
        return s.with_columns(done=pl.when(row).then(False).otherwise(pl.col("done")))
    if rule == "done_ends":
        return s.with_columns(terminated=pl.when(row).then(False).otherwise(pl.col("terminated")))
    if rule == "chain":
        return s.with_columns(state=pl.when(row).then(pl.lit("Z")).otherwise(pl.col("state")))
    if rule == "outcome":
        return s.with_columns(outcome=pl.when(row).then(0.5).otherwise(pl.col("outcome")))
    if rule == "group_task":
        return s.with_columns(
            task_id=pl.when(pl.col("traj_id") == "T2").then(pl.lit("other")).otherwise("task_id")
        )
    if rule == "group_traj":
        return s.with_columns(group_id=pl.when(row).then(pl.lit("g2")).otherwise(pl.col("group_id")))
    if rule == "finite":
        return s.with_columns(reward=pl.when(row).then(float("nan")).otherwise(pl.col("reward")))
    raise AssertionError(rule)


RULE_WORDS = {
    "unique": "not unique",
    "contiguous": "contiguous",
    "one_done": "done",
    "done_ends": "neither terminated nor truncated",
    "chain": "next_state",
    "outcome": "outcome not constant",
    "group_task": "different task_id",
    "group_traj": "more than one group",
    "finite": "NaN",
}


@pytest.mark.parametrize("rule", sorted(RULE_WORDS))
@pytest.mark.parametrize("command", ["graph", "advantage"])
def test_bad_steps_are_rejected_with_one_line(runner, tmp_path, rule, command):
    path = _write_plain(_break(rule), tmp_path / "bad.parquet")
    result = runner.invoke(app, [command, str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert RULE_WORDS[rule] in lines[0]
    assert not (tmp_path / "o" / "nodes.parquet").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["graph", "{steps}", "-o", "{out}", "--set", "graph.canonicalise=exact"], "unknown config key"),
        (["graph", "{steps}", "-o", "{out}", "--set", "graph.truncation=drop"], "graph.truncation"),
        (["graph", "{tmp}/missing.parquet", "-o", "{out}"], "file not found"),
        (["graph", "{steps}"], "-o OUT_DIR"),
        (["solve", "{tmp}/empty"], "nodes.parquet"),
        (["solve", "{tmp}/graphed", "--set", "solve.gamma=1.0"], "cycle"),
        (
            ["advantage", "{steps}", "-o", "{out}", "--set", "advantage.estimator=magic"],
            "must be a registered estimator",
        ),
        (["advantage", "{steps}", "-o", "{out}", "--set", "advantage.gae=maybe"], "advantage.gae"),
        (["graph", "{run}"], "--iter"),
        (["graph", "{run}", "--iter", "0"], "steps.parquet"),
        (["graph", "{run}", "--iter", "0", "--config", "{tmp}/c.toml"], "own config.toml"),
    ],
)
def test_bad_arguments_exit_2(runner, tmp_path, args, words):
    steps = _write_plain(fig2_steps(), tmp_path / "steps.parquet")
    (tmp_path / "empty").mkdir()
    credit.graph_files(steps, tmp_path / "graphed", Config(), require_stamp=False)
    run = create_run(tmp_path / "run", Config())
    fill = {"steps": str(steps), "out": str(tmp_path / "out"), "tmp": str(tmp_path), "run": str(run.root)}
    result = runner.invoke(app, [a.format(**fill) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr


def test_missing_column_is_named(runner, tmp_path):
    path = tmp_path / "s.parquet"
    fig2_steps().drop("next_state").write_parquet(path)
    result = runner.invoke(app, ["graph", str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "next_state" in result.stderr


def test_metrics_per_task_type(runner, tmp_path):
    from tests.helpers.credit_cases import make_steps

    pick = make_steps([("p1", [("A", "B", 0.0), ("B", "E", 0.0)], 1.0, "terminated")], group="gp", task="tp")
    look = fig2_steps().with_columns(group_id=pl.lit("gl"), task_id=pl.lit("tl"))
    steps = pl.concat(
        [pick.with_columns(task_type=pl.lit("pick")), look.with_columns(task_type=pl.lit("look"))]
    )
    path = _write_plain(steps, tmp_path / "s.parquet")
    out = tmp_path / "o"
    assert runner.invoke(app, ["advantage", str(path), "-o", str(out)]).exit_code == 0
    graph = read_table(out / "metrics_graph.parquet", "metrics")
    by_type = {
        (t, n): v for t, n, v in graph.select("task_type", "name", "value").iter_rows() if t is not None
    }
    # pick: a 2-step chain (nodes A, B, E; each out-edge alone); look: the hand example.
    assert by_type[("pick", "nodes")] == 3 and by_type[("pick", "share_steps_group_ge2")] == 0.0
    assert by_type[("look", "nodes")] == 5 and by_type[("look", "mean_node_group_size")] == 4.0
    overall = dict(zip(*graph.filter(pl.col("task_type").is_null()).select("name", "value"), strict=True))
    assert overall["nodes"] == 8 and overall["edges"] == 14
    solve = read_table(out / "metrics_solve.parquet", "metrics")
    prop = solve.filter((pl.col("task_type") == "pick") & (pl.col("name") == "share_steps_propagation_1"))
    assert prop["value"].to_list() == [1.0]


CREDIT_COLUMNS = [
    "group_id",
    "traj_id",
    "step",
    "state",
    "next_state",
    "action",
    "reward",
    "outcome",
    "done",
    "terminated",
    "truncated",
]


def test_advantage_on_a_table_with_only_the_credit_columns(runner, tmp_path):
    # An external table without iter, task_id, task_type, observation, valid or any policy column.
    steps = synth_steps(groups=3, group_size=4, horizon=5, seed=2)
    minimal = _write_plain(steps, tmp_path / "full.parquet")
    pl.read_parquet(minimal).select(CREDIT_COLUMNS).write_parquet(tmp_path / "minimal.parquet")
    full_out, min_out = tmp_path / "full", tmp_path / "min"
    for path, out in ((minimal, full_out), (tmp_path / "minimal.parquet", min_out)):
        result = runner.invoke(app, ["advantage", str(path), "-o", str(out)])
        assert result.exit_code == 0, result.output
    got = read_table(min_out / "advantages.parquet", "advantages")
    want = read_table(full_out / "advantages.parquet", "advantages")
    assert got.equals(want)
    # The defaults are what docs/design.md §3 says: iter 0, task_id = group_id, task_type "", observation = state.
    from schemas import conform

    filled = pl.from_arrow(conform(pl.read_parquet(tmp_path / "minimal.parquet"), "steps"))
    assert (filled["iter"] == 0).all() and (filled["task_type"] == "").all() and filled["valid"].all()
    assert filled["task_id"].equals(filled["group_id"].alias("task_id"))
    assert filled["observation"].equals(filled["state"].alias("observation"))
    # A credit column is still required, and named.
    pl.read_parquet(minimal).select([c for c in CREDIT_COLUMNS if c != "terminated"]).write_parquet(
        tmp_path / "bad.parquet"
    )
    result = runner.invoke(app, ["advantage", str(tmp_path / "bad.parquet"), "-o", str(tmp_path / "b")])
    assert result.exit_code == 2 and "terminated" in result.stderr


def test_schema_steps_says_which_columns_credit_needs(runner):
    result = runner.invoke(app, ["schema", "steps"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 4}
    for column in CREDIT_COLUMNS:
        assert "required (credit)" in rows[column], column
    assert "default group_id" in rows["task_id"] and "default state" in rows["observation"]
    assert "default 0" in rows["iter"] and 'default ""' in rows["task_type"]
    for column in ("prompt", "response_ids", "response_logprobs"):
        assert "training only" in rows[column], column


def test_file_mode_reads_each_input_once_and_matches_separate_stages(runner, tmp_path, monkeypatch):
    """``graft advantage FILE -o OUT`` chains graph -> solve -> advantage in memory: the steps file is
    read once, no table it just wrote is read back, and the outputs equal three separate commands'."""
    steps = synth_steps(groups=3, group_size=4, horizon=6, seed=2).with_columns(
        task_type=pl.format("t{}", pl.col("group_id").rank("dense") % 2)
    )
    path = _write_plain(steps, tmp_path / "steps.parquet")
    reads: list[str] = []
    real = runners.read_table
    monkeypatch.setattr(
        runners, "read_table", lambda p, *a, **k: reads.append(Path(p).name) or real(p, *a, **k)
    )
    chained = tmp_path / "chained"
    assert runner.invoke(app, ["advantage", str(path), "-o", str(chained)]).exit_code == 0
    assert reads == ["steps.parquet"]
    reads.clear()
    assert runner.invoke(app, ["advantage", str(path), "-o", str(chained)]).exit_code == 0
    assert sorted(reads) == ["edges.parquet", "nodes.parquet", "steps.parquet", "values.parquet"]
    separate = tmp_path / "separate"
    assert runner.invoke(app, ["graph", str(path), "-o", str(separate)]).exit_code == 0
    assert runner.invoke(app, ["solve", str(separate)]).exit_code == 0
    reads.clear()
    assert runner.invoke(app, ["advantage", str(path), "-o", str(separate)]).exit_code == 0
    assert sorted(reads) == ["edges.parquet", "nodes.parquet", "steps.parquet", "values.parquet"]
    for name in ("nodes", "edges", "values", "advantages"):
        assert read_table(chained / f"{name}.parquet", name).equals(
            read_table(separate / f"{name}.parquet", name)
        )

    def measured(folder: Path, stage: str) -> pl.DataFrame:
        return read_table(folder / f"metrics_{stage}.parquet", "metrics").filter(pl.col("name") != "seconds")

    # per-task-type rows too (`graft solve DIR` alone knows no steps file, so only its overall rows)
    assert measured(chained, "graph").equals(measured(separate, "graph"))
    assert measured(chained, "graph")["task_type"].drop_nulls().unique().sort().to_list() == ["t0", "t1"]
    overall = pl.col("task_type").is_null()
    assert measured(chained, "solve").filter(overall).equals(measured(separate, "solve"))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_solve_refuses_values_that_overflow(runner, tmp_path):
    """Rewards of 1e308 are finite, their sums are not: solve and advantage stop, nothing is written."""
    steps = fig2_steps().with_columns(pl.lit(1e308).alias("reward"), pl.lit(1e308).alias("outcome"))
    path = _write_plain(steps, tmp_path / "steps.parquet")
    out = tmp_path / "out"
    assert runner.invoke(app, ["graph", str(path), "-o", str(out)]).exit_code == 0
    result = runner.invoke(app, ["solve", str(out), "--set", "solve.gamma=0.9"])
    assert result.exit_code == 2, result.output
    assert "solve:" in result.stderr and "node value(s) are not finite" in result.stderr
    assert "Traceback" not in result.output and not (out / "values.parquet").exists()
    result = runner.invoke(app, ["advantage", str(path), "-o", str(out), "--set", "solve.gamma=0.9"])
    assert result.exit_code == 2 and "not finite" in result.stderr
    assert not (out / "advantages.parquet").exists()


@pytest.mark.parametrize(
    "override",
    ["solve={gamma=0.5}", "solve.gamma=0.5", "solve={step_rewards='values'}", "graph={time_key=true}"],
)
def test_advantage_on_a_run_resolves_inline_tables_like_dotted_keys(runner, tmp_path, override):
    # --set 'solve={gamma=0.5}' skipped the re-solve (only dotted keys were looked at)
    from schemas.config import load_config

    run = create_run(tmp_path / "run", Config())
    steps = synth_steps(groups=3, group_size=4, horizon=6, seed=3)
    run.write(0, "steps", steps.with_columns(pl.lit(0, dtype=pl.Int32).alias("iter")))
    assert runner.invoke(app, ["advantage", str(run.root), "--iter", "0"]).exit_code == 0
    result = runner.invoke(app, ["advantage", str(run.root), "--iter", "0", "--set", override, "--force"])
    assert result.exit_code == 0, result.output
    expected = credit.run_all(steps, load_config(None, [override])).advantages["advantage"].to_numpy()
    np.testing.assert_allclose(run.read(0, "advantages")["advantage"].to_numpy(), expected, atol=1e-9)
