"""Layer 2, what learners and servers share to talk: the RPC world (names, ports, joining, leaving) and shared
memory on one host. No Lightning."""
