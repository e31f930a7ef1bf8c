"""The RPC world's helpers that need no peer: the interface towards the rendezvous, the stderr filter."""

import os

from lightning_rudra.rpc_world import address_towards, interface_towards, quiet_peers_leaving

PEER_LEFT = (b"[W1201 06:58:43.926196677 tensorpipe_agent.cpp:941] RPC agent for learner1 encountered error when "
             b"reading incoming response from server: EOF: end of file (this error originated at tensorpipe/transport"
             b"/uv/connection_impl.cc:132)\n")


def test_the_interface_towards_the_rendezvous():
    assert address_towards("127.0.0.1") == "127.0.0.1" and interface_towards("127.0.0.1") == "lo"


def test_only_tensorpipes_peer_left_lines_are_dropped_while_leaving(capfd):
    with quiet_peers_leaving():
        os.write(2, PEER_LEFT)
        os.write(2, b"[W1201 06:58:43.1 tensorpipe_agent.cpp:620] RPC agent for server won't send response to "
                    b"request #69 to learner1, as the agent is shutting down\n")
        os.write(2, b"a warning of the user's own\n")
    os.write(2, PEER_LEFT)  # outside the context: passes
    assert capfd.readouterr().err == "a warning of the user's own\n" + PEER_LEFT.decode()
