"""Prototypes of lightning_rudra changes, measured without editing the package.

Server side: a prototype server process runs lightning_rudra's own ``server.process.main`` after loading ``core/protocol.py``
from its source with a few exact text replacements (``PATCHES``): the change a maintainer would make, nothing
else. ``prototype_server(patches)`` makes ``join`` on this learner start that server instead of the stock one.
Learner side: ``LEARNER_PATCHES`` modify a ``Learner`` object in place.
"""

import contextlib
import os
import subprocess
import sys
from typing import Any, Iterator, Sequence

# name -> (file in lightning_rudra, e.g. "core/protocol.py", [(old text, new text)]); each old text must occur exactly once.
# Measured this way and since applied to the package (commit a75c8be): "finite_sum" (Server.push checked every
# gradient with torch.isfinite(g).all(), ~10x a memcpy at 10 M; now a sum first) and "skip_div1" (no division
# of the summed gradients by a count of 1).
PATCHES: dict[str, tuple[str, list[tuple[str, str]]]] = {}


def reuse_pack_buffers(layout) -> None:
    """Learner-side prototype "pack_reuse": ``layout.pack`` writes into two buffers it keeps and alternates,
    instead of new memory on every push (whose first touch page-faults: a 40 MB allocation costs ~3 memcpys).
    Two, because with ``overlap=True`` a push's tensors may still be being sent while the next push packs;
    ``Learner.push`` settles push k before it returns from push k+1, so push k+2 may reuse push k's buffer.
    The change in ``Learner.push``: ``self.grad_layouts[index].pack(grads, _CPU, out=self._next_buffer(index))``
    with ``FlatLayout.pack`` taking an ``out`` list (``torch.cat(..., out=buffer)``)."""
    import torch

    original = layout.pack
    buffers: list = [None, None]
    turn = [0]

    def pack(tensors, device=None):
        i = turn[0]
        turn[0] ^= 1
        if buffers[i] is None:
            buffers[i] = original(tensors, device)
        else:
            for buffer, idx in zip(buffers[i], layout.groups.values()):
                torch.cat([tensors[j].detach().reshape(-1) for j in idx], out=buffer)
        return buffers[i]

    layout.pack = pack


LEARNER_PATCHES = {
    "pack_reuse": lambda learner: [reuse_pack_buffers(layout) for layout in learner.links[0].grad_layouts]
}

_ENTRY = """import sys, types
package = types.ModuleType("lightning_rudra")
package.__path__ = [{package!r}]
sys.modules["lightning_rudra"] = package
from benchmarks.proto import load_patched
load_patched({package!r}, {patches!r})
from lightning_rudra.server.process import main
main()"""


def patched_source(package_dir: str, filename: str, patches: Sequence[str]) -> str:
    with open(os.path.join(package_dir, filename)) as f:
        source = f.read()
    for name in patches:
        target, replacements = PATCHES[name]
        if target != filename:
            continue
        for old, new in replacements:
            if source.count(old) != 1:
                raise RuntimeError(
                    f"patch {name!r} no longer applies to lightning_rudra/{filename}: its text "
                    f"occurs {source.count(old)} times"
                )
            source = source.replace(old, new)
    return source


def load_patched(package_dir: str, patches: Sequence[str]) -> None:
    """Install ``lightning_rudra.<file>`` modules built from patched source (before anything imports them)."""
    import types

    for filename in sorted({PATCHES[name][0] for name in patches}):
        name = "lightning_rudra." + filename[:-3].replace("/", ".")
        module = types.ModuleType(name)
        module.__file__ = os.path.join(package_dir, filename)
        sys.modules[name] = module
        exec(compile(patched_source(package_dir, filename, patches), module.__file__, "exec"), module.__dict__)


def patched_protocol(patches: Sequence[str]):
    """A private copy of ``lightning_rudra.core.protocol`` with ``patches`` applied (for in-process measurements)."""
    import types

    from lightning_rudra.core import protocol

    if not patches:
        return protocol
    package = os.path.dirname(os.path.dirname(protocol.__file__))
    module = types.ModuleType("benchmarks_patched_protocol")
    module.__file__ = protocol.__file__
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is created
    exec(compile(patched_source(package, "core/protocol.py", patches), module.__file__, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def prototype_server(patches: Sequence[str]) -> Iterator[None]:
    """While active, ``lightning_rudra.learner.world.join`` (learner 0) starts a server running ``patches``."""
    from lightning_rudra.server import launch

    if not patches:
        yield
        return
    package = os.path.dirname(os.path.dirname(launch.__file__))
    for name in patches:  # fail here, in the learner, rather than in the server process
        patched_source(package, PATCHES[name][0], [name])
    original = launch.start_server

    def start_server(*args: Any) -> subprocess.Popen:
        return original(*args, code=_ENTRY.format(package=package, patches=list(patches)))

    launch.start_server = start_server
    try:
        yield
    finally:
        launch.start_server = original
