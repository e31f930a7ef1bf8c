"""The timeline switch (``RUDRA_TIMELINE``): what a process writes, and ``benchmarks.timeline``'s breakdown of a
step from it."""

import os
import warnings

import pytest

from benchmarks import timeline as breakdown
from lightning_rudra.transport import timeline


@pytest.fixture
def switch(monkeypatch, tmp_path):
    """The switch on, into ``tmp_path / "timeline"``; read again afresh before and after the test."""
    directory = tmp_path / "timeline"
    monkeypatch.setenv(timeline.TIMELINE, str(directory))
    timeline._reset()
    yield directory
    if timeline._file is not None:
        timeline._file.close()
    timeline._reset()


def _lines(directory) -> list[list[str]]:
    return [line.split() for name in sorted(os.listdir(directory)) for line in open(directory / name)]


def test_off_without_the_switch_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(timeline.TIMELINE, raising=False)
    timeline._reset()
    timeline.mark("push", 0, 0)
    assert not timeline.enabled()
    assert timeline._file is None and os.listdir(tmp_path) == []
    timeline._reset()


def test_each_event_is_a_line_of_its_time_name_and_numbers(switch):
    timeline.mark("push", 3, 0)
    timeline.mark("sent", 3, 1)
    assert timeline.enabled()
    (first, second) = _lines(switch)
    assert first[1:] == ["push", "3", "0"] and second[1:] == ["sent", "3", "1"]
    assert 0 <= float(second[0]) - float(first[0]) < 60


def test_a_forked_child_writes_a_file_of_its_own(switch):
    timeline.mark("push", 0, 0)
    child = os.fork()
    if child == 0:  # the child: its own file, whatever the parent's lock and file were
        timeline.mark("push", 1, 0)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0
    files = sorted(os.listdir(switch))
    assert len(files) == 2
    assert sorted(tuple(line[1:]) for line in _lines(switch)) == [("push", "0", "0"), ("push", "1", "0")]


def test_past_the_limit_the_timeline_stops(switch, monkeypatch):
    monkeypatch.setattr(timeline, "LIMIT", 3)
    for step in range(5):
        timeline.mark("push", 0, step)
    assert [line[3] for line in _lines(switch)] == ["0", "1", "2"]
    assert not timeline.enabled()


def test_a_directory_that_cannot_be_written_warns_once_and_the_run_goes_on(monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(timeline.TIMELINE, str(blocker / "timeline"))
    timeline._reset()
    with pytest.warns(UserWarning, match="cannot write the timeline there"):
        timeline.mark("push", 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.mark("push", 0, 1)  # off: no second warning, no error
        assert not timeline.enabled()
        timeline._reset()
        timeline.mark("push", 0, 2)  # where warnings are errors (-W error), the first one too: off, no error
        assert not timeline.enabled() and timeline._file is None
    timeline._reset()


def test_a_write_that_fails_turns_the_timeline_off_with_one_warning(switch):
    """A full disk: the event is lost, the timeline is off, the run goes on; also where warnings are errors."""
    timeline.mark("push", 0, 0)

    class Full:
        closed = False

        def write(self, line):
            raise OSError(28, "No space left on device")

        def close(self):
            self.closed = True

    full = Full()
    timeline._file.close()
    timeline._file = full
    with pytest.warns(UserWarning, match="writing the timeline failed"):
        timeline.mark("push", 0, 1)
    assert full.closed and not timeline.enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.mark("push", 0, 2)
    timeline._reset()
    timeline._file = full  # and with warnings as errors, the first failure too
    timeline._directory = str(switch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.mark("push", 0, 3)
    assert not timeline.enabled()


def _events(*rows):
    return [(t, event, tuple(numbers)) for t, event, *numbers in rows]


def test_breakdown_of_a_step_part_by_part():
    """Learner 0 pushes to servers 0 and 1 each step (10 ms apart: 0.0, 0.010, ...); server 1's reply arrives last,
    so it is the path; its parts and the compute make up the step."""
    rows = []
    for k in range(5):
        t = k * 0.010
        rows += [
            (t, "push", 0, 0),
            (t + 0.0005, "sent", 0, 0),
            (t + 0.0010, "sent", 0, 1),
            (t + 0.0015, "received", 0, 0),
            (t + 0.0020, "answered", 0, 0),
            (t + 0.0030, "received", 1, 0),
            (t + 0.0050, "answered", 1, 0),
            (t + 0.0025, "reply", 0, 0),
            (t + 0.0060, "reply", 0, 1),
            (t + 0.0065, "loaded", 0, 0),
            (t + 0.0070, "loaded", 0, 1),
        ]
    result = breakdown.breakdown(sorted(_events(*rows)), warmup=1)
    row = result[0]
    assert row["steps"] == 3 and row["path"] == 1
    assert row["step"] == pytest.approx(0.010) and row["compute"] == pytest.approx(0.003)
    expected = {
        0: {"pack": 0.0005, "push": 0.0010, "server": 0.0005, "reply": 0.0005, "load": 0.0040},
        1: {"pack": 0.0010, "push": 0.0020, "server": 0.0020, "reply": 0.0010, "load": 0.0010},
    }
    for server, parts in expected.items():
        assert row["servers"][server] == pytest.approx(parts)
    path = row["servers"][1]
    assert sum(path.values()) + row["compute"] == pytest.approx(row["step"])
    assert "| 0 | 1 (path) | 1.0 | 2.0 | 2.0 | 1.0 | 1.0 | 3.0 | 10.0 | 3 |" in breakdown.table(result)


def test_breakdown_of_a_node_member_and_of_overlap():
    """A node's member (learner 1) has no server events: its server parts are unknown, not wrong; under overlap
    (learner 0) a push's weights are loaded at the next push: no compute."""
    rows = []
    for k in range(4):
        t = k * 0.010
        rows += [
            (t, "push", 1, 0),
            (t + 0.001, "sent", 1, 0),
            (t + 0.004, "loaded", 1, 0),
            (t + 0.0001, "push", 0, 0),
            (t + 0.0002, "sent", 0, 0),
            (t + 0.0003, "received", 0, 0),
            (t + 0.0004, "answered", 0, 0),
            (t + 0.0005, "reply", 0, 0),
            (t + 0.0102, "loaded", 0, 0),  # in the next push
        ]
    result = breakdown.breakdown(sorted(_events(*rows)), warmup=0)
    member = result[1]["servers"][0]
    assert member["push"] is None and member["server"] is None and member["pack"] == pytest.approx(0.001)
    assert result[1]["compute"] == pytest.approx(0.006)
    assert result[0]["compute"] is None and result[0]["servers"][0]["reply"] == pytest.approx(0.0001)
