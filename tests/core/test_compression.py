"""Compressed pushes (``compression="bf16"``): what the server receives over k pushes adds up to the true gradients
but for the last rounding's error, each learner and part keeps its own error, a NaN does not spoil later pushes,
and the server widens what it receives before its checks; the weights sent back as bfloat16 differences keep
sender and receiver equal bit for bit, within the last difference's rounding of the true weights."""

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.core.compression import ErrorFeedback, WeightDeltas, compression_option, decompress
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.update import Push


def gradients(k, numel=10_000, seed=0):
    """k gradients of mixed magnitudes (1e-6 to 1e2), as a layer's gradients differ."""
    generator = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-6, 3, (numel,), generator=generator).float()
    return [torch.randn(numel, generator=generator) * scale for _ in range(k)]


def test_what_the_server_receives_over_k_pushes_is_the_true_sum_but_the_last_rounding():
    feedback = ErrorFeedback("bf16")
    true = gradients(200)
    received = torch.zeros(true[0].numel(), dtype=torch.float64)
    for g in true:
        [wire] = feedback.compress("part", [g.clone()])
        assert wire.dtype == torch.bfloat16
        received += decompress([wire], [torch.float32])[0].double()
    [last_error] = feedback.residuals["part"]
    # the error still held is under half a bfloat16 unit (2^-8 relative, 8 bits of mantissa) of the last push
    assert (last_error.abs() <= 2.0**-8 * wire.double().abs()).all()
    # what arrived + that error = the true sum, but for float32's rounding of each gradient + error (2^-24 each)
    total = torch.stack(true).double().sum(0)
    bound = len(true) * 2.0**-23 * torch.stack(true).abs().amax(0).double()
    assert ((received + last_error.double() - total).abs() <= bound).all()
    # and the sum of what arrived is off the true sum by that error only, not by 200 roundings
    assert ((received - total).abs() <= 2.0**-8 * wire.double().abs() + bound).all()


def test_without_the_error_kept_the_same_rounding_adds_up_and_with_it_it_does_not():
    """A gradient that bfloat16 always rounds the same way (1 + 2^-9 to 1): 100 pushes lose 100 × 2^-9 without
    error feedback, less than one rounding with it."""
    g = torch.full((4,), 1.0 + 2.0**-9)
    plain = sum(g.to(torch.bfloat16).double() for _ in range(100))
    feedback = ErrorFeedback("bf16")
    kept = sum(feedback.compress("part", [g.clone()])[0].double() for _ in range(100))
    true = 100 * g.double()
    assert torch.allclose(true - plain, torch.full((4,), 100 * 2.0**-9, dtype=torch.float64))
    assert ((true - kept).abs() <= 2.0**-8 * g.double()).all()


def test_each_key_keeps_its_own_error_and_other_dtypes_travel_as_they_are():
    """1 + 2^-9 rounds to 1 in bfloat16 (a unit is 2^-7 there), leaving 2^-9; pushed again with that error added,
    1 + 2^-8 (a tie, to even: 1) leaves 2^-8."""
    feedback = ErrorFeedback("bf16")
    g = torch.full((3,), 1.0 + 2.0**-9)
    ints = torch.arange(3)
    wire = feedback.compress(("server 0", "learner 0"), [g.clone(), ints])
    assert wire[1] is ints and feedback.residuals[("server 0", "learner 0")][1] is None
    assert wire[0].tolist() == [1.0] * 3 and feedback.residuals[("server 0", "learner 0")][0].tolist() == [2.0**-9] * 3
    feedback.compress(("server 0", "learner 1"), [g.clone(), ints])
    feedback.compress(("server 0", "learner 0"), [g.clone(), ints])
    assert feedback.residuals[("server 0", "learner 0")][0].tolist() == [2.0**-8] * 3
    assert feedback.residuals[("server 0", "learner 1")][0].tolist() == [2.0**-9] * 3  # learner 0's not added


def test_a_gradient_with_nan_or_inf_keeps_no_error_for_the_next_push():
    feedback = ErrorFeedback("bf16")
    feedback.compress("part", [torch.full((2,), 1.0 + 2.0**-9)])
    wire = feedback.compress("part", [torch.tensor([float("inf"), 1.0])])  # the server refuses it
    assert torch.isinf(wire[0][0]) and feedback.residuals["part"] == [None]
    assert feedback.compress("part", [torch.tensor([0.5, 0.25])])[0].tolist() == [0.5, 0.25]


def test_the_server_widens_a_compressed_gradient_and_applies_it_as_the_float32_one():
    def server():
        w = torch.zeros(3)
        opt = torch.optim.SGD([w], lr=0.5)
        return Server(ProtocolConfig(1, "async"), [w], [], [OptimizerSpec.from_optimizer(opt, [w])])

    g = torch.tensor([1.0, -(2.0**-3), 3.0])  # exact in bfloat16
    compressed, full = server(), server()
    for s, grad in ((compressed, g.to(torch.bfloat16)), (full, g)):
        result = s.push(Push(0, 0, [grad], torch.tensor([True]), 0, [{"lr": 0.5}], []))
        assert result.status == "accepted"
    assert torch.equal(compressed.params[0], full.params[0]) and compressed.params[0].dtype == torch.float32
    with pytest.raises(ValueError, match=r"expected \[torch.float32 x 3\]"):  # the checks still judge the size
        compressed.push(Push(0, 0, [torch.zeros(2, dtype=torch.bfloat16)], torch.tensor([True]), 1, [{"lr": 0.5}], []))


def test_decompress_widens_only_a_wire_dtype_where_the_layout_holds_float32():
    half, ints = torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.int64)
    bf16_in_a_bf16_layout = torch.ones(2, dtype=torch.bfloat16)
    out = decompress([half, ints, bf16_in_a_bf16_layout], [torch.float32, torch.int64, torch.bfloat16])
    assert out[0] is half and out[1] is ints and out[2] is bf16_in_a_bf16_layout
    assert decompress([torch.ones(1, dtype=torch.bfloat16)], [torch.float32])[0].dtype == torch.float32


@pytest.mark.parametrize("value", ["fp16", "bfloat16", True, 16])
def test_a_compression_that_is_not_known_is_refused_with_what_is_expected(value):
    with pytest.raises(ValueError, match=rf"compression={value!r} is not supported: expected None .* or 'bf16'"):
        RudraStrategy(compression=value)
    assert compression_option("none") is None and RudraStrategy(compression="bf16").compression == "bf16"


def test_weights_sent_as_differences_stay_equal_on_both_sides_and_within_the_last_rounding_of_the_truth():
    """A server's float32 weights change by an update a step (10 000 steps of mixed magnitudes), an int64 buffer
    travels as it is: the learner's copy equals the server's record of it bit for bit, and differs from the true
    weights by at most half a bfloat16 unit of the last difference (no error builds up)."""
    server, learner = WeightDeltas("bf16"), WeightDeltas("bf16")
    weights = [torch.randn(10_000), torch.arange(3)]
    message = server.encode("learner 1", learner.count(), weights)
    assert message.whole and learner.decode(message)[0].equal(weights[0])
    for update in gradients(200):
        before = learner.held[None][1][0].clone()
        weights = [weights[0] - 0.1 * update, weights[1] + 1]
        message = server.encode("learner 1", learner.count(), weights)
        assert not message.whole and message.flats[0].dtype == torch.bfloat16 and message.flats[1].dtype == torch.int64
        held = learner.decode(message)
        assert held[0].equal(server.held["learner 1"][1][0]) and held[1].equal(weights[1])
        last = (weights[0] - before).abs()
        assert bool(((held[0] - weights[0]).abs() <= last * 2**-8 + 1e-30).all())


def test_a_receiver_whose_count_differs_gets_the_whole_weights_again():
    """A new process of a learner (count 0), or one that missed a message: the server sends float32 weights."""
    server = WeightDeltas("bf16")
    weights = [torch.randn(100)]
    assert server.encode("learner 1", 0, weights).whole
    assert not server.encode("learner 1", 1, weights).whole
    assert server.encode("learner 1", 1, weights).whole  # the receiver applied 1, the sender sent 2
    assert server.encode("learner 1", 0, weights).whole  # a new process
    message = server.encode("learner 2", 0, weights)
    assert message.whole and message.flats[0].dtype == torch.float32
