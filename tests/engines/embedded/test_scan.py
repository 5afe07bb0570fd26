"""The recurrent form of both mixers (``RecurrentMixer.scan``) against the per-token loop it
replaced (``tests/oracles/scan.py: reference_scan``): the same outputs, final and captured states bit
for bit, on ragged batches, float32 and bf16 inputs. The scan is what makes a cache hit reproduce
a cold recompute exactly in float32 (decode and prefill run the one recurrence), so a faster form
must not move a single bit."""

from __future__ import annotations

import pytest
import torch

from tests.oracles.scan import make_case, reference_scan


@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [7, 7], [37, 5, 1, 20], [64, 63], [150, 64, 129, 3]])
def test_the_scan_is_the_per_token_loop_bit_for_bit(family, dtype, lengths):
    mixer, case = make_case(family, lengths, dtype, seed=sum(lengths) + len(lengths))
    with torch.no_grad():
        got = mixer.scan(*case)
        out, conv, ssm, captured = reference_scan(mixer, *case)
    assert torch.equal(got.out, out)
    assert torch.equal(got.conv, conv) and torch.equal(got.ssm, ssm)
    assert got.captured.keys() == captured.keys()
    for key, (c, s) in captured.items():
        assert torch.equal(got.captured[key][0], c) and torch.equal(got.captured[key][1], s), key
