"""SamplingParams refuses what the sampler cannot run: NaN, infinities, out-of-range values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", math.nan), ("min_p", -0.1), ("min_p", 1.01),
    ("presence_penalty", math.nan), ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.nan), ("repetition_penalty", math.inf),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True), ("top_k", -2), ("logprobs", -1),
    ("seed", 1.5), ("priority", "high"),
])
def test_bad_values_are_refused_with_the_field_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_numpy_scalars_and_edges_are_accepted():
    p = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.0), top_p=1.0, min_p=1.0,
                       presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.3, seed=np.int64(7))
    assert p.greedy and p.has_penalties
    assert not SamplingParams().has_penalties
