"""The runtime model (lightning_rudra.core.runtime) on cases worked out by hand: each must come out exactly."""

import math

import pytest

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime import (
    Cluster,
    Link,
    Payload,
    Protocol,
    Scenario,
    ServerCost,
    StepTime,
    simulate,
)
from lightning_rudra.core.timing import push_order


def run(protocol, learners=4, straggler=None, batches=400, cluster=None, server=None, parameters=1000, **kw):
    times = [StepTime(1.0)] * learners
    if straggler:
        times = times[:-1] + [StepTime(1.0, slowdown=straggler)]
    return simulate(
        Scenario(
            protocol,
            cluster or Cluster(1, learners),
            times,
            Payload(parameters),
            server or ServerCost(),
            batches=batches,
            **kw,
        )
    )


@pytest.mark.parametrize("learners", [1, 2, 4, 8])
def test_async_equal_learners_without_costs(learners):
    p = run(Protocol("async"), learners=learners)
    assert p.samples_per_s == pytest.approx(learners / 1.0)
    assert p.mean_staleness == learners - 1 and set(p.staleness) == {learners - 1}


def test_hardsync_waits_for_a_3x_straggler():
    p = run(Protocol("hardsync"), learners=4, straggler=3, batches=400)
    assert p.epoch_s == pytest.approx(100 * 3.0)  # 100 rounds of 3
    assert p.update_times[:3] == [3.0, 6.0, 9.0]
    assert p.samples_per_s == pytest.approx(4 / 3)
    assert p.mean_staleness == 0 and p.wasted == 0


def test_batchsync_k_lambda_with_a_3x_straggler():
    # by hand, with the pacing (lightning_rudra.server.pacing): at 1 the 3 fast learners push on clock 0; learner 0's
    # next gradient (due 2) comes before the round can close (the straggler's, due 3, is its 3rd), so it is answered
    # at once; learners 1 and 2 would next push at 2, no sooner than learner 0's: their replies wait. At 2 learner
    # 0's second gradient closes the round (0, 1, 2, 0) and all three go on. So a round every 2, learner 0 giving
    # two gradients of it; the straggler's step (3) always spans a round's close: every one of its gradients is
    # wasted, 1/3 a second against 2 applied: 1/7 of those computed
    p = run(Protocol("batchsync"), learners=4, straggler=3, batches=400)
    assert p.update_times[:4] == [2.0, 4.0, 6.0, 8.0]
    assert [r for r, _ in p.push_order[:8]] == [0, 1, 2, 0] * 2
    assert p.wasted == pytest.approx(1 / 7, abs=0.005)
    assert p.applied_per_s == pytest.approx(2.0, rel=0.01)
    assert p.samples_per_s == pytest.approx(2 + 1 / 3, rel=0.01)  # batches ended, the wasted ones too
    assert p.epoch_s == pytest.approx(200, abs=1.5)  # 100 updates, one every 2
    assert p.staleness == {0: sum(p.staleness.values())}
    assert all(r != 3 for r, _ in p.push_order[:-1])  # but the very last, the others out of batches


@pytest.mark.parametrize("learners", [2, 4, 8])
def test_batchsync_equal_learners_k_lambda_is_hardsync(learners):
    # fixed, equal steps: every reply but the round's last waits (the others' gradients close the round first), so
    # each learner gives one gradient a round: nothing wasted, hardsync's rate and rounds
    link = Link(1e9, 1e-3)
    cluster = Cluster(1, learners, local=link)
    batch = run(Protocol("batchsync"), learners=learners, cluster=cluster, parameters=100_000)
    hard = run(Protocol("hardsync"), learners=learners, cluster=cluster, parameters=100_000)
    assert batch.wasted == 0 and batch.updates == hard.updates == 400 // learners
    assert batch.samples_per_s == pytest.approx(hard.samples_per_s)
    assert batch.update_times == pytest.approx(hard.update_times)


def test_backup_learner_drops_every_gradient_of_the_straggler():
    p = run(Protocol("hardsync", backup=1), learners=4, straggler=3, batches=300)
    # rounds of 1: the 3 fast learners close each (at the epoch's very end, the rounds wait for the batches the
    # straggler wasted, dealt again)
    assert p.update_times[:95] == [float(t) for t in range(1, 96)]
    assert p.wasted == pytest.approx((1 / 3) / (3 + 1 / 3), abs=0.005)
    assert all(r != 3 for r, _ in p.push_order)  # the straggler's gradients are never applied


def test_link_bound():
    # 4 learners on one host, the server on its own: the host's link carries every push (8 MB at 1 Gbit/s)
    link = Link(1e9)
    cluster = Cluster(1, 4, link=link, servers_on="own_hosts")
    times = StepTime(1e-9)
    p = simulate(Scenario(Protocol("async"), cluster, times, Payload(2_000_000), batches=2000))
    assert p.samples_per_s == pytest.approx(1e9 / (8 * 8_000_000), rel=0.01)


def test_server_bound_and_num_servers():
    cost = ServerCost(push_per_parameter=1e-3, update_per_parameter=1e-3)  # 1000 parameters: 2 s a push
    one = run(Protocol("async"), learners=8, server=cost, cluster=Cluster(1, 8), batches=800)
    assert one.samples_per_s == pytest.approx(1 / 2.0, rel=0.01)
    assert one.server_utilisation[0] == pytest.approx(1.0, rel=0.01)
    two = run(Protocol("async"), learners=8, server=cost, cluster=Cluster(1, 8, num_servers=2), batches=800)
    assert two.samples_per_s == pytest.approx(2 * one.samples_per_s, rel=0.01)  # each server holds half: 1 s


def test_softsync_applies_c_gradients_per_update():
    p = run(Protocol("softsync", n=2), learners=4, batches=400)
    assert p.updates == 200 and p.samples_per_s == pytest.approx(4.0)
    assert p.mean_staleness == pytest.approx(1.5)


def test_ssp_never_exceeds_its_bound():
    free = run(Protocol("async"), learners=4, straggler=3, batches=400)
    assert free.max_staleness == 9
    held = run(Protocol("async", max_staleness=4), learners=4, straggler=3, batches=400)
    assert held.max_staleness <= 4 and held.held_s > 0


def test_node_aggregation_sends_one_push_per_host():
    # 2 hosts × 2 learners, one server per host, the link the only cost: aggregation halves what crosses it
    link = Link(1e9)
    kw = dict(hosts=2, learners_per_host=2, link=link, num_servers=2)
    times = StepTime(1e-9)
    on = simulate(Scenario(Protocol("hardsync"), Cluster(**kw), times, Payload(1_000_000), batches=400))
    off = simulate(
        Scenario(Protocol("hardsync"), Cluster(**kw, node_aggregation=False), times, Payload(1_000_000), batches=400)
    )
    assert on.samples_per_s == pytest.approx(2 * off.samples_per_s, rel=0.02)


def test_deterministic_given_a_seed():
    def once(seed):
        times = StepTime(1.0, "exponential", 1.0)
        return simulate(Scenario(Protocol("async"), Cluster(2, 4), times, Payload(1000), batches=300, seed=seed))

    a, b, c = once(1), once(1), once(2)
    assert a.to_dict() == b.to_dict() and a.push_order == b.push_order
    assert a.push_order != c.push_order


@pytest.mark.parametrize("protocol", [Protocol("async"), Protocol("softsync", n=2), Protocol("hardsync")])
def test_its_timing_orders_the_simulated_learners_as_predicted(protocol):
    times = [StepTime(1.0, "lognormal", 0.4)] * 4
    p = simulate(Scenario(protocol, Cluster(1, 4, local=Link(1e9, 1e-3)), times, Payload(100_000), batches=200))
    steps = [len(a) for a in p.arrivals]
    order = push_order(protocol.name, steps, p.timing(), [0] * 4)
    assert order == [r for r, _ in p.push_order]


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: Link(bandwidth=0), "Link bandwidth=0"),
        (lambda: Link(latency=-1), "Link latency=-1"),
        (lambda: Payload(100, "fp8"), "compression='fp8'"),
        (lambda: Cluster(num_servers=0), "num_servers=0"),
        (lambda: Cluster(cores=0), "cores=0"),
        (lambda: StepTime(sleep=-1), "StepTime sleep=-1"),
        (lambda: Link(per_byte=-1), "Link per_byte=-1"),
        (lambda: StepTime(kind="gamma"), "kind='gamma'"),
        (lambda: StepTime(mean=math.nan), "StepTime mean=nan"),
        (lambda: Protocol("bsp"), "protocol='bsp'"),
        (lambda: Protocol("async", backup=1), "backup=1"),
        (lambda: Protocol("async", n=4), "n=4 is for protocol='softsync'"),
        (lambda: run(Protocol("hardsync", backup=4), learners=4), "backup=4"),
        (lambda: run(Protocol("async", max_staleness=1), learners=4), "max_staleness=1"),
        (lambda: Scenario(Protocol(), Cluster(), StepTime(), Payload(1), batches=0), "batches=0"),
    ],
)
def test_bad_inputs_are_refused_by_name(make, named):
    with pytest.raises(ConfigurationError, match="expected") as error:
        make()
    assert named in str(error.value)


def test_cores_shared_by_the_learners_of_a_host():
    # 4 learners on 2 cores, 1 s of one core a step, no other cost: each runs at half speed, 2 s a step
    times = StepTime(1.0)
    p = simulate(Scenario(Protocol("async"), Cluster(1, 4, cores=2), times, Payload(1000), batches=400))
    assert p.samples_per_s == pytest.approx(4 / 2.0)
    # one learner asleep 3 s after each compute: while it sleeps the other 3 share 2 cores. By hand, the first
    # steps: 4 busy until 2 s; the sleeper sleeps to 5 s, the 3 others run at 2/3 and end 1.5 s later (3.5 s),
    # then again 4.5 s at 2/3 ... the fast ones' step is 1.5 s while the sleeper sleeps
    sleeper = simulate(
        Scenario(
            Protocol("async"),
            Cluster(1, 4, cores=2),
            [times, times, times, StepTime(1.0, sleep=3.0)],
            Payload(1000),
            batches=8,
            warmup=0,
        )
    )
    assert sleeper.arrivals[0][:2] == pytest.approx([2.0, 3.5])


def test_a_busy_waiting_straggler_holds_its_core():
    # 2 learners on 1 core; the second spins 1 s after its 1 s compute: the first shares the core throughout
    spin = simulate(
        Scenario(
            Protocol("async"),
            Cluster(1, 2, cores=1),
            [StepTime(1.0), StepTime(1.0, spin=1.0)],
            Payload(1000),
            batches=4,
            warmup=0,
        )
    )
    # both at half a core to 2 s; then the first shares the core with the spinner (to 3 s), then with its next
    # compute: half a core throughout, its second step ends at 4 s
    assert spin.arrivals[0][:2] == pytest.approx([2.0, 4.0])
    asleep = simulate(
        Scenario(
            Protocol("async"),
            Cluster(1, 2, cores=1),
            [StepTime(1.0), StepTime(1.0, sleep=1.0)],
            Payload(1000),
            batches=4,
            warmup=0,
        )
    )
    assert asleep.arrivals[0][:2] == pytest.approx([2.0, 3.0])  # its second step alone on the core


def test_a_working_server_takes_a_share_of_the_cores():
    # 1 learner, 1 core, 1 s compute and a 1 s push at the server on the same host: never together, 2 s a step
    cost = ServerCost(push_per_parameter=1e-3)
    one = run(Protocol("async"), learners=1, server=cost, cluster=Cluster(1, 1, cores=1), batches=50)
    assert one.samples_per_s == pytest.approx(1 / 2.0)
    # 2 learners and the server on 2 cores: at most 2 busy at any time (one learner computes while the other's push
    # is served, in turn): nothing slows, as without sharing
    two = run(Protocol("async"), learners=2, server=cost, cluster=Cluster(1, 2, cores=2), batches=400)
    free = run(Protocol("async"), learners=2, server=cost, cluster=Cluster(1, 2), batches=400)
    assert two.samples_per_s == pytest.approx(free.samples_per_s)


def test_shared_memory_reads_the_newest_weights():
    # equal learners, no cost: all push at once and reply at once. A reply carrying the weights of its sending
    # sees λ - 1 updates by the others; read from shared memory once every update of the moment is made, the k-th
    # of a moment's pushes is stale by k (0 .. λ - 1): mean (λ - 1) / 2
    sent = run(Protocol("async"), learners=4)
    read = run(Protocol("async"), learners=4, cluster=Cluster(1, 4, shared_memory=True))
    assert sent.mean_staleness == 3
    assert read.mean_staleness == pytest.approx(1.5)
    assert read.mean_run_staleness == pytest.approx(1.5)


def test_the_run_staleness_counts_the_first_pushes():
    # 2 equal learners, 10 batches: the first push has σ 0, the other 9 σ 1
    p = run(Protocol("async"), learners=2, batches=10)
    assert p.run_staleness == {0: 1, 1: 9}


def test_transport_cost_per_message_and_byte():
    # a learner and its server on one host through RPC: 1 ms a message and 1 ns a byte on 1 MB each way, 1 s compute
    link = Link(per_message=1e-3, per_byte=1e-9)
    p = run(Protocol("async"), learners=1, cluster=Cluster(1, 1, local=link), parameters=250_000, batches=50)
    assert p.samples_per_s == pytest.approx(1 / (1.0 + 2 * (1e-3 + 1e-3)))
    assert Link(1e9).with_transport(link).overhead(1e6) == pytest.approx(2e-3)


def test_transport_cost_occupies_a_core_on_both_ends():
    # 1 s compute, RPC of 0.5 s a message on one host (half on the sender's core, half on the receiver's), no server
    # cost. One learner on 1 core: 1 + 0.5 + 0.5 = 2 s a step, as with the cost as latency. Two learners on 1 core:
    # every second of a step is CPU work, so the core makes one step per 2 s in all (the cost as latency would
    # overlap one's compute with the other's transfers: a step a second). On 2 cores each has its own: 2 s a step.
    link = Link(per_message=0.5)
    one = run(Protocol("async"), learners=1, cluster=Cluster(1, 1, local=link, cores=1), batches=50)
    assert one.samples_per_s == pytest.approx(1 / 2.0)
    shared = run(Protocol("async"), learners=2, cluster=Cluster(1, 2, local=link, cores=1), batches=100)
    assert shared.samples_per_s == pytest.approx(1 / 2.0)
    own = run(Protocol("async"), learners=2, cluster=Cluster(1, 2, local=link, cores=2), batches=100)
    assert own.samples_per_s == pytest.approx(2 / 2.0)


def test_transport_cost_between_hosts_is_work_on_each_end():
    # 2 hosts of one machine with 1 core, a learner on host 0 and its server on host 1, a free wire with 0.5 s of
    # RPC a message: as above, 2 s a step alone; a second learner on host 0 shares the one core: 2 s a step in all
    link = Link().with_transport(Link(per_message=0.5))
    common = dict(link=link, servers_on="own_hosts", cores=1, one_machine=True)
    one = run(Protocol("async"), learners=1, cluster=Cluster(1, 1, **common), batches=50)
    assert one.samples_per_s == pytest.approx(1 / 2.0)
    two = run(Protocol("async"), learners=2, cluster=Cluster(1, 2, **common), batches=100)
    assert two.samples_per_s == pytest.approx(1 / 2.0)


# the report at λ = 8 as the model computes it (its log-normal steps of mean 0.25 s since StepTime's lognormal keeps its
# mean): refactors must not move the numbers. (gbit, protocol, servers, samples/s, mean σ, wasted, epoch s)
REPORT_8 = [
    (10, "hardsync", 32, 252.004210, 0.0, 0.0, 8.147548),
    (10, "hardsync backup=1", 16, 225.595980, 0.0, 0.123288, 10.223446),
    (10, "batchsync", 32, 252.004210, 0.0, 0.0, 8.147548),
    (10, "1-softsync", 4, 272.327226, 0.875, 0.0, 8.002582),
    (10, "4-softsync", 4, 266.408636, 3.489362, 0.0, 8.161637),
    (10, "async", 4, 263.891279, 7.0, 0.0, 8.216637),
    (10, "async, SSP s=16", 4, 263.891279, 7.0, 0.0, 8.216637),
    (100, "hardsync", 8, 607.956557, 0.0, 0.0, 3.383839),
    (100, "hardsync backup=1", 8, 598.980791, 0.0, 0.123288, 3.808084),
    (100, "batchsync", 8, 607.956557, 0.0, 0.0, 3.383839),
    (100, "1-softsync", 4, 768.753906, 0.875, 0.0, 2.761215),
    (100, "4-softsync", 16, 791.421245, 3.5, 0.0, 2.677311),
    (100, "async", 8, 742.893114, 7.0, 0.0, 2.864358),
    (100, "async, SSP s=16", 8, 742.893114, 7.0, 0.0, 2.864358),
]


def test_the_reports_numbers_are_unchanged():
    from benchmarks.predict.report import report

    _, rows = report([8])
    got = [
        (r["gbit"], r["protocol"], r["servers"], r["samples_per_s"], r["mean_staleness"], r["wasted"], r["epoch_s"])
        for r in rows
    ]
    assert [g[:3] for g in got] == [e[:3] for e in REPORT_8]
    assert [g[3:] for g in got] == [pytest.approx(e[3:], abs=1e-6) for e in REPORT_8]


@pytest.mark.parametrize(
    "protocol, held_s, run_staleness",
    [
        (Protocol("softsync", n=2, max_staleness=2), 129.0, {0: 34, 1: 36, 2: 131}),
        (Protocol("async", max_staleness=3), 291.0, {0: 1, 1: 1, 2: 2, 3: 196}),
    ],
)
def test_ssp_with_a_tight_bound_holds_as_before(protocol, held_s, run_staleness):
    # the gate's slow path (the bound reached, a 3x straggler): as computed before the gate kept its clocks sorted
    p = run(protocol, learners=4, straggler=3, batches=200)
    assert p.held_s == pytest.approx(held_s) and p.run_staleness == run_staleness


def test_bf16_codec_cost_on_pushes_that_cross_hosts():
    # 1 learner, its server on a host of its own: 1 s compute + 1 s of the learner's bf16 work (1 ms × 1000
    # parameters), then 1 s of the server's: 3 s a step; without compression none of it
    payload = Payload(1000, "bf16", learner_codec=1e-3, server_codec=1e-3)
    cluster = Cluster(1, 1, servers_on="own_hosts")
    p = simulate(Scenario(Protocol("async"), cluster, StepTime(1.0), payload, batches=50))
    assert p.samples_per_s == pytest.approx(1 / 3.0)
    plain = simulate(Scenario(Protocol("async"), cluster, StepTime(1.0), Payload(1000), batches=50))
    assert plain.samples_per_s == pytest.approx(1.0)


def test_measured_compute_adds_lightnings_time_per_step():
    # benchmarks.predict's table: a model's forward + backward alone, plus Lightning's own time per step
    from benchmarks.predict.compute import compute_s

    table = {
        "rows": [
            {"model": "m", "batch_size": 32, "median_s": 0.05},
            {"model": "m", "batch_size": 16, "median_s": 0.03},
        ],
        "lightning": {"overhead_s": 0.002},
    }
    assert compute_s(table, "m", 16) == pytest.approx(0.032)
    assert compute_s(table, "m", 32) == pytest.approx(0.052)
