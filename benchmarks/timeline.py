"""A step's time, part by part, from the timeline a run writes with ``RUDRA_TIMELINE=<directory>``
(:mod:`lightning_rudra.transport.timeline`): ``python -m benchmarks.timeline DIRECTORY``, or a whole run across two
hosts with ``python -m benchmarks.profile timeline``.

Per learner and step (from one ``push`` to the next): per server, the parts of the push's path, each the median over
the steps past ``warmup``:

- *pack*: from the step's push to its part for that server sent (cut, packed, compressed: handed to the transport);
- *push*: from sent to the server's ``received`` (on the wire, and read whole; a node's leader first waits for its
  members' gradients and sums them);
- *server*: from received to ``answered`` (the update; under hardsync also the wait for the round's other pushes);
- *reply*: from answered to the learner's ``reply`` (the weights on the wire, and read whole: the reply arrived; over
  the push stream only, which every learner uses unless the server offers none);
- *load*: from reply to ``loaded`` (the learner came to that reply, after those before it, and loaded its weights).

And per learner: the *step* and its *compute*, from the last weights loaded to the next push (the forward and backward
passes and Lightning's loop; none under ``overlap``, whose weights are loaded at the next push). The *path* is the
server whose reply arrived last in most steps: its parts and the compute make up the step. The k-th ``sent``
of a learner to a server is matched with the k-th ``received`` there from that learner, and so on; the pushes a node's
leader makes for its members (node-local aggregation) are the leader's, its members have no server parts.
"""

import argparse
import collections
import os
import statistics
from typing import Any, Optional

PARTS = ("pack", "push", "server", "reply", "load")
EVENTS = ("sent", "received", "answered", "reply", "loaded")  # a push's, per learner and server, in order: PARTS end


def read(directory: str) -> list[tuple[float, str, tuple[int, ...]]]:
    """Every process's events in ``directory``, in time order: (time, event, numbers)."""
    events = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2:
                    events.append((float(fields[0]), fields[1], tuple(int(n) for n in fields[2:])))
    events.sort(key=lambda e: e[0])
    return events


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def breakdown(events: list[tuple[float, str, tuple[int, ...]]], warmup: int = 2) -> dict[int, dict[str, Any]]:
    """Per learner: ``steps`` (counted), ``step`` and ``compute`` (median s), ``path`` (the server whose reply arrived
    last in most steps) and ``servers``: per server, the median s of each part of :data:`PARTS` (None where never
    seen)."""
    pushes: dict[int, list[float]] = collections.defaultdict(list)
    # (learner, server) -> the times of each event, in order
    of: dict[str, dict[tuple[int, int], list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for t, event, numbers in events:
        if event == "push":
            pushes[numbers[0]].append(t)
        elif event in ("sent", "reply", "loaded"):
            of[event][numbers[0], numbers[1]].append(t)
        elif event in ("received", "answered"):
            of[event][numbers[1], numbers[0]].append(t)  # a server's are (server, learner)
    result = {}
    for learner, times in sorted(pushes.items()):
        servers = sorted({s for (r, s) in of["sent"] if r == learner})
        parts: dict[int, dict[str, list[float]]] = {s: collections.defaultdict(list) for s in servers}
        steps, computes, last = [], [], collections.Counter()
        for k in range(warmup, len(times) - 1):
            begin, end = times[k], times[k + 1]
            loaded_at, arrived_at = {}, {}
            for s in servers:
                key = (learner, s)
                at = {event: of[event][key][k] if k < len(of[event][key]) else None for event in EVENTS}
                if at["sent"] is None:
                    continue
                marks = [begin] + [at[event] for event in EVENTS]  # each part runs from one mark to the next
                for part, start, stop in zip(PARTS, marks, marks[1:]):
                    if start is not None and stop is not None:
                        parts[s][part].append(stop - start)
                if at["loaded"] is not None:
                    loaded_at[s] = at["loaded"]
                if at["reply"] is not None:
                    arrived_at[s] = at["reply"]
            steps.append(end - begin)
            if loaded_at and max(loaded_at.values()) <= end:
                computes.append(end - max(loaded_at.values()))
            if arrived_at:
                last[max(arrived_at, key=arrived_at.__getitem__)] += 1
        result[learner] = {
            "steps": len(steps),
            "step": _median(steps),
            "compute": _median(computes),
            "path": last.most_common(1)[0][0] if last else None,
            "servers": {s: {part: _median(parts[s][part]) for part in PARTS} for s in servers},
        }
    return result


def table(result: dict[int, dict[str, Any]]) -> str:
    """The breakdown as a Markdown table, a row per learner and server, in ms."""

    def ms(value: Optional[float]) -> str:
        return "–" if value is None else f"{1000 * value:.1f}"

    lines = [
        "| learner | server | " + " | ".join(PARTS) + " | compute | step | steps |",
        "|---" * (len(PARTS) + 5) + "|",
    ]
    for learner, row in result.items():
        for server, parts in row["servers"].items():
            path = " (path)" if server == row["path"] else ""
            lines.append(
                f"| {learner} | {server}{path} | "
                + " | ".join(ms(parts[part]) for part in PARTS)
                + f" | {ms(row['compute'])} | {ms(row['step'])} | {row['steps']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the directory RUDRA_TIMELINE named")
    parser.add_argument("--warmup", type=int, default=2, help="steps per learner left out at the start")
    args = parser.parse_args()
    print("times in ms, medians over the steps\n")
    print(table(breakdown(read(args.directory), args.warmup)))


if __name__ == "__main__":
    main()
