"""Gradient clipping on the server, in-process with scripted pushes: the server clips the gradient its update
applies (DDP's averaged gradient), not each learner's (:mod:`lightning_rudra.core.clipping`)."""

import pytest
import torch

from lightning_rudra.core.clipping import Clipping, across_servers, check_servers
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.update import Push
from tests.lightning_models import flat, regression_data

CLIPPERS = {"norm": torch.nn.utils.clip_grad_norm_, "value": torch.nn.utils.clip_grad_value_}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(epochs: int, batch_size: int):
    """DistributedSampler's order over all learners (seeded by the epoch), cut into batches of μλ."""
    x, y = regression_data().tensors
    for epoch in range(epochs):
        for rows in torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch)).split(batch_size):
            yield x, y, rows


def hardsync(clipping: Clipping, learners: int = 2, mu: int = 8, clip_on_learners: bool = False) -> torch.Tensor:
    """λ learners push their gradient of μ samples each round; the server clips (or, as Lightning did before, each
    learner clips its own gradient and the server averages them)."""
    model = net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    spec = OptimizerSpec.from_optimizer(opt, params)
    server = Server(ProtocolConfig(learners, "hardsync"), [p.detach().clone() for p in params], [], [spec])
    layout = server.grad_layouts[0]
    for x, y, rows in batches(2, mu * learners):
        for learner in range(learners):
            part = rows[learner::learners]
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
            if clip_on_learners:
                CLIPPERS[clipping.algorithm](params, clipping.value)
            server.push(
                Push(
                    learner,
                    0,
                    layout.pack([p.grad for p in params]),
                    torch.ones(len(params), dtype=torch.bool),
                    server.clock,
                    [hyperparameters(g) for g in opt.param_groups],
                    [],
                    clipping=() if clip_on_learners else (clipping,),
                )
            )
        with torch.no_grad():
            for p, w in zip(params, server.params):
                p.copy_(w)
    return flat(params)


def sgd(batch_size: int, clipping=None) -> torch.Tensor:
    """One process, batches of μλ, clipped as Lightning clips before the step."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y, rows in batches(2, batch_size):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if clipping is not None:
            CLIPPERS[clipping.algorithm](model.parameters(), clipping.value)
        opt.step()
    return flat(model.parameters())


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_hardsync_clipped_equals_sgd_with_batch_mu_lambda_clipped(algorithm):
    clipping = Clipping(0.5, algorithm)
    expected = sgd(16, clipping)
    assert (expected - sgd(16)).abs().max() > 0.04, "clipping at 0.5 changes this run"
    torch.testing.assert_close(hardsync(clipping), expected, rtol=0, atol=1e-5)
    # what Lightning's clipping on each learner made of it: another update
    assert (hardsync(clipping, clip_on_learners=True) - expected).abs().max() > 0.04


def one_weight_server(protocol: str, learners: int, lr_modulation: str = "none", compensation: str = "none") -> Server:
    w = torch.zeros(2)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=0.1), [w])
    config = ProtocolConfig(learners, protocol, lr_modulation=lr_modulation, compensation=compensation)
    return Server(config, [w], [], [spec])


def push(server: Server, learner: int, grad, timestamp: int, *clipping):
    return server.push(
        Push(
            learner,
            0,
            [torch.tensor(grad)],
            torch.tensor([True]),
            timestamp,
            [{"lr": 0.1}],
            [],
            clipping=clipping,
        )
    )


def test_softsync_clips_the_mean_of_an_updates_gradients():
    server = one_weight_server("softsync", 2)  # n = 1: c = 2
    push(server, 0, [3.0, 0.0], 0, Clipping(1.0))
    push(server, 1, [3.0, 8.0], 0, Clipping(1.0))  # mean [3, 4], norm 5: clipped to [0.6, 0.8]
    assert server.params[0].tolist() == pytest.approx([-0.06, -0.08])
    push(server, 0, [3.0, -0.5], 1, Clipping(2.0, "value"))
    push(server, 1, [-1.0, 0.5], 1, Clipping(2.0, "value"))  # mean [1, 0]: nothing to clip
    assert server.params[0].tolist() == pytest.approx([-0.16, -0.08])


def test_async_clips_each_gradient_as_its_learner_would_and_per_gradient_modulation_still_applies():
    server = one_weight_server("async", 2, lr_modulation="per_gradient")
    push(server, 0, [0.0, 0.0], 0)
    push(server, 0, [0.0, 0.0], 1)
    result = push(server, 1, [3.0, 4.0], 0, Clipping(1.0))  # σ = 2: the gradient is halved
    assert result.update.staleness == (2,)
    # clipped to norm 1 as learner 1 would have ([0.6, 0.8]), then halved by the modulation
    assert server.params[0].tolist() == pytest.approx([-0.03, -0.04])
    push(server, 1, [3.0, -4.0], 2, Clipping(1.0, "value"))  # σ = 1
    assert server.params[0].tolist() == pytest.approx([-0.13, 0.06])


def test_a_push_without_clipping_is_not_clipped():
    server = one_weight_server("async", 1)
    push(server, 0, [30.0, 40.0], 0)
    assert server.params[0].tolist() == pytest.approx([-3.0, -4.0])


@pytest.mark.parametrize(
    "clipping, message",
    [
        ((0.5, "norm"), "expected a Clipping"),
        (Clipping.__new__(Clipping), "gradient clipping value None is not valid"),  # unpickled without fields
    ],
)
def test_a_bad_clipping_request_is_refused_and_changes_nothing(clipping, message):
    server = one_weight_server("async", 1)
    with pytest.raises(ValueError, match=message):
        push(server, 0, [3.0, 4.0], 0, clipping)
    with pytest.raises(ValueError, match="expected a tuple of Clipping"):
        server.push(
            Push(0, 0, [torch.tensor([3.0, 4.0])], torch.tensor([True]), 0, [{"lr": 0.1}], [], clipping=Clipping(1.0))
        )
    assert server.clock == 0 and server.params[0].tolist() == [0.0, 0.0] and server.stats.gradients == 0


@pytest.mark.parametrize(
    "value, algorithm, message",
    [
        (0.0, "norm", "expected a finite number > 0"),
        (float("inf"), "value", "expected a finite number > 0"),
        (True, "norm", "expected a finite number > 0"),
        (1.0, "max", "'max' is not supported: expected one of 'norm', 'value'"),
    ],
)
def test_bad_clipping_values_are_refused_by_name(value, algorithm, message):
    with pytest.raises(ValueError, match=message):
        Clipping(value, algorithm)


def test_a_bool_is_not_a_server_index_of_a_clipping():
    with pytest.raises(ValueError, match=r"gradient clipping servers \(True, 2\) are not valid"):
        Clipping(1.0, "norm", (True, 2))


def test_one_clipping_by_norm_per_step_where_several_servers_hold_an_optimizers_parameters():
    check_servers([Clipping(0.5), Clipping(0.5)], 1, 0)  # one server: torch clips each in turn
    check_servers([Clipping(0.5), Clipping(0.5, "value")], 3, 0)
    with pytest.raises(
        ValueError, match=r"2 gradient clippings by norm.*optimizer 1 are cut between 2 .*num_servers=1"
    ):
        check_servers([Clipping(0.5), Clipping(0.2)], 2, 1)


def hardsync_over_two_servers(clipping: Clipping, learners: int = 2, mu: int = 8) -> torch.Tensor:
    """As :func:`hardsync`, with the model cut between two servers (the first layer on one, the last on the
    other); each round's clipping by norm takes the norm over both parts, as the server processes exchange it."""
    model = net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    cut = [params[:2], params[2:]]
    servers = []
    for part in cut:
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(part, lr=0.05, momentum=0.9), part)
        servers.append(Server(ProtocolConfig(learners, "hardsync"), [p.detach().clone() for p in part], [], [spec]))
    for x, y, rows in batches(2, mu * learners):
        for learner in range(learners):
            part = rows[learner::learners]
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
            grads = [p.grad for p in params]
            told = across_servers([clipping], [0, 1], grads, 0, norm=False)  # hardsync: the servers exchange it
            for server, held in zip(servers, cut):
                hparams = [hyperparameters(g) for g in opt.param_groups]
                server.push(
                    Push(
                        learner,
                        0,
                        server.grad_layouts[0].pack([p.grad.clone() for p in held]),
                        torch.ones(len(held), dtype=torch.bool),
                        server.clock,
                        hparams,
                        [],
                        clipping=told,
                    )
                )
        if clipping.algorithm == "norm":  # each round waits for the other server's part of the norm
            assert all(0 in server.awaiting_norm for server in servers)
            total = sum(server.awaiting_norm[0][0].partial for server in servers) ** 0.5
            for server in servers:
                server.apply_norm(0, total)
        assert not any(server.awaiting_norm for server in servers)
        with torch.no_grad():
            for p, w in zip(params, servers[0].params + servers[1].params):
                p.copy_(w)
    return flat(params)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_hardsync_over_two_servers_clips_by_the_norm_over_every_part(algorithm):
    clipping = Clipping(0.5, algorithm)
    expected = sgd(16, clipping)
    torch.testing.assert_close(hardsync_over_two_servers(clipping), expected, rtol=0, atol=1e-5)


def test_an_update_of_one_gradient_over_two_servers_is_clipped_by_the_learners_norm():
    # async: the learner's gradient [3, 4 | 0] (norm 5) cut between two servers, each scaling its part alike
    first, second = one_weight_server("async", 1), one_weight_server("async", 1)
    told = across_servers([Clipping(1.0)], [0, 1], [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])], 0)
    assert told == (Clipping(1.0, "norm", (0, 1), 5.0),)
    push(first, 0, [3.0, 4.0], 0, *told)
    push(second, 0, [0.0, 0.0], 0, *told)
    assert first.params[0].tolist() == pytest.approx([-0.06, -0.08]) and second.params[0].tolist() == [0.0, 0.0]
    # a clipping by value before it: the norm is of the gradient as that leaves it
    told = across_servers([Clipping(2.0, "value"), Clipping(1.0)], [0, 1], [torch.tensor([6.0, 0.0])] * 2, 0)
    assert told[1].norm == pytest.approx(8**0.5)


def test_softsync_with_c_above_one_refuses_clipping_by_norm_over_several_servers():
    server = one_weight_server("softsync", 2)  # n = 1: c = 2
    with pytest.raises(ValueError, match=r"softsync averaging c=2 gradients.*λ=2, n=1.*n=2 \(c=1\)"):
        push(server, 0, [3.0, 4.0], 0, Clipping(1.0, "norm", (0, 1), 5.0))
    push(server, 0, [3.0, 4.0], 0, Clipping(1.0, "value"))  # by value: exact at any cut


def test_successive_clippings_apply_in_turn_as_lightning_applies_successive_calls():
    # norm 0.3, then value 0.02 (a module's configure_gradient_clipping calling clip_gradients twice)
    server = one_weight_server("async", 1)
    push(server, 0, [3.0, 4.0], 0, Clipping(0.3), Clipping(0.02, "value"))  # [0.18, 0.24], then [0.02, 0.02]
    assert server.params[0].tolist() == pytest.approx([-0.002, -0.002])


def test_a_server_that_holds_none_of_an_optimizers_gradients_clips_nothing():
    w = torch.zeros(2)
    spec = OptimizerSpec(torch.optim.SGD, [([], {"lr": 0.1})])  # the optimizer's parameters are on another server
    server = Server(ProtocolConfig(1, "async"), [w], [], [spec])
    for algorithm in ("norm", "value"):
        result = server.push(
            Push(
                0,
                0,
                [],
                torch.zeros(0, dtype=torch.bool),
                server.clock,
                [{"lr": 0.1}],
                [],
                None,
                clipping=(Clipping(1.0, algorithm),),
            )
        )
        assert result.update is not None
    assert server.clock == 2 and w.tolist() == [0.0, 0.0]


def test_hardsync_refuses_a_push_whose_clippings_differ_from_the_rounds_first_and_changes_nothing():
    # the newest push's request cannot hold: push order differs per server, so the servers would clip differently
    server = one_weight_server("hardsync", 2)
    push(server, 1, [3.0, 4.0], 0)  # learner 1 asks for no clipping
    with pytest.raises(
        ValueError,
        match=r"learner 0 asked for clipping by norm to 1.0 of optimizer 0's gradient, and learner 1 for no clipping in "
        r"the same hardsync round.*same gradient_clip_val",
    ):
        push(server, 0, [3.0, 4.0], 0, Clipping(1.0, "norm", (0, 1)))
    assert server.awaited(0) == {0} and server.clock == 0  # learner 0 may still push what learner 1 asked
    push(server, 0, [3.0, 4.0], 0)
    assert server.clock == 1
    # the same request, with a learner's norm or without: the same clipping
    push(server, 0, [3.0, 4.0], 1, Clipping(1.0, "norm", (0, 1), 5.0))
    push(server, 1, [3.0, 4.0], 1, Clipping(1.0, "norm", (0, 1)))
    assert 0 in server.awaiting_norm


def test_the_server_refuses_two_clippings_by_norm_over_several_servers_in_one_push():
    server = one_weight_server("hardsync", 2)
    two = (Clipping(1.0, "norm", (0, 1)), Clipping(0.5, "norm", (0, 1)))
    with pytest.raises(ValueError, match=r"2 gradient clippings by norm in one step .*between 2 parameter servers"):
        push(server, 0, [3.0, 4.0], 0, *two)
    assert server.awaited(0) == {0, 1}
    push(server, 0, [3.0, 4.0], 0, Clipping(1.0, "norm"), Clipping(0.5, "norm"))  # one server: torch's, in turn


def test_a_hardsync_server_that_holds_none_of_an_optimizers_parameters_does_not_wait_for_the_norm():
    w = torch.zeros(2)
    spec = OptimizerSpec(torch.optim.SGD, [([], {"lr": 0.1})])  # held by servers 0 and 2, not this one
    server = Server(ProtocolConfig(2, "hardsync"), [w], [], [spec])
    for learner in (0, 1):
        args = ([], torch.zeros(0, dtype=torch.bool), server.clock, [{"lr": 0.1}], [], None)
        result = server.push(Push(learner, 0, *args, clipping=(Clipping(1.0, "norm", (0, 2)),)))
    assert result.update is not None and not server.awaiting_norm and server.clock == 1


def test_across_servers_names_the_servers_and_sends_a_norm_only_where_asked():
    grads = [torch.tensor([3.0, 4.0])]
    assert across_servers([Clipping(1.0)], [0, 1], grads, 0, norm=False) == (Clipping(1.0, "norm", (0, 1)),)
    assert across_servers([Clipping(1.0)], [0, 1], grads, 0) == (Clipping(1.0, "norm", (0, 1), 5.0),)


def test_norm64_in_pieces_is_the_float64_norm_of_the_whole():
    """Taken a piece of ``NORM_PIECE`` elements at a time (large, non-contiguous, small, empty and absent tensors
    together), the norm is the whole's in float64 to float64's rounding; a float32 norm is not (1e-4 off
    for 5 M elements), nor would one overflow: elements of 1e30 square past float32's range."""
    from lightning_rudra.core.clipping import NORM_PIECE, norm64

    generator = torch.Generator().manual_seed(0)
    large = torch.randn(3 * NORM_PIECE + 7, generator=generator)
    strided = torch.randn(NORM_PIECE + 5, 3, generator=generator).t()  # not contiguous, more than one piece
    tensors = [large, strided, torch.ones(3), torch.empty(0), None]
    whole = torch.cat([t.double().reshape(-1) for t in tensors if t is not None])
    assert norm64(tensors) == pytest.approx(torch.linalg.vector_norm(whole).item(), rel=1e-12)
    huge = torch.full((NORM_PIECE + 1,), 1e30)
    assert norm64([huge]) == pytest.approx(huge[0].item() * (NORM_PIECE + 1) ** 0.5, rel=1e-12)
    assert norm64([]) == 0.0 and norm64([None]) == 0.0
