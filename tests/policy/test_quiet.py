"""Library notices graft keeps off the user's terminal (stages/policy/quiet.py)."""

from __future__ import annotations

import logging
import warnings

import pytest

from stages.policy.quiet import quiet_vllm


@pytest.fixture
def vllm_logger_level():
    logger = logging.getLogger("vllm")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_vllm_notices_below_the_level_and_its_future_warnings_are_dropped(vllm_logger_level) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_vllm("error")
        assert not logging.getLogger("vllm.triton_utils.importing").isEnabledFor(logging.WARNING)
        assert logging.getLogger("vllm.engine").isEnabledFor(logging.ERROR)
        assert logging.getLogger("graft_test").isEnabledFor(logging.WARNING)  # other loggers untouched
        for module in ("vllm.triton_utils.dispatcher", "graft_test.module"):
            warnings.warn_explicit("reduce_op is deprecated", FutureWarning, "x.py", 1, module=module)
        warnings.warn_explicit("a real problem", UserWarning, "x.py", 1, module="vllm.config")
    assert [(str(w.message), w.category) for w in caught] == [
        ("reduce_op is deprecated", FutureWarning),  # from graft_test.module, not from vLLM
        ("a real problem", UserWarning),
    ]


def test_an_unknown_level_name_changes_nothing(vllm_logger_level) -> None:
    vllm_logger_level.setLevel(logging.NOTSET)
    with warnings.catch_warnings():
        quiet_vllm("loud")
        assert vllm_logger_level.level == logging.NOTSET
