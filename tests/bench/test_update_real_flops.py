"""The update bench's model-FLOPs count (bench/speed/update_real.py ``train_flops``), by hand.

The count feeds the bench's MFU column, so a wrong count is a wrong speed figure: with the trunk once
per row, the optimizer steps' forward runs only the top K layers and must be counted as such.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch

from bench.speed.update_real import train_flops
from stages.update.batching import UpdateRows

LAYERS, HIDDEN, VOCAB = 4, 3, 5


class FakeModel(torch.nn.Module):
    """Parameters that add up to a known body: 40 body weights + the 15-weight embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB)
        self.embed = torch.nn.Parameter(torch.zeros(VOCAB * HIDDEN))
        self.body = torch.nn.Parameter(torch.zeros(40))


def one_row(prompt: int, response: int) -> UpdateRows:
    return UpdateRows(
        keys=pl.DataFrame({"group_id": ["g"], "traj_id": ["t"], "step": [0]}),
        prompt_ids=[np.zeros(prompt, dtype=np.int64)],
        response_ids=[np.zeros(response, dtype=np.int64)],
        advantage=np.zeros(1),
        behaviour_logprobs=[None],
        choices=[None],
        chosen=np.full(1, -1),
    )


def by_hand(length: int, response: int, grad_layers: int, forward_layers: int) -> float:
    body, embed = 40, VOCAB * HIDDEN
    attention = 4 * LAYERS * HIDDEN * length * (length + 1) / 2
    forward = forward_layers / LAYERS * (2 * body * length + attention) + 2 * embed * response
    backward = 2 * (
        2 * body / LAYERS * grad_layers * length + attention * grad_layers / LAYERS + 2 * embed * response
    )
    return forward + backward


def test_every_layer_forward_by_default() -> None:
    # 3 prompt + 2 response tokens: length 5; forward 2·40·5 + 4·4·3·15 = 400 + 720, head 2·15·2 = 60
    flops = train_flops(FakeModel(), one_row(3, 2), grad_layers=LAYERS)
    assert flops == pytest.approx((400 + 720 + 60) + 2 * (400 + 720 + 60))
    assert flops == pytest.approx(by_hand(5, 2, LAYERS, LAYERS))


@pytest.mark.parametrize("top", [1, 2, 3])
def test_the_shared_trunk_counts_only_the_top_layers_forward(top: int) -> None:
    model, rows = FakeModel(), one_row(7, 3)
    full = train_flops(model, rows, grad_layers=top)
    trunk = train_flops(model, rows, grad_layers=top, forward_layers=top)
    assert trunk == pytest.approx(by_hand(10, 3, top, top))
    # what the cache saves is exactly the trunk's forward: (L - K)/L of the body and the attention
    assert full - trunk == pytest.approx((LAYERS - top) / LAYERS * (2 * 40 * 10 + 4 * LAYERS * HIDDEN * 55))
