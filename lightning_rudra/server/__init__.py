"""Layer 2, what runs in a parameter-server process: the process and its RPC entry points, the server's state over
futures, and who is in the run. Imports only ``core`` and ``transport``; no Lightning."""
