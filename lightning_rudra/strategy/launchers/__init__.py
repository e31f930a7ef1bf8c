"""How the strategy starts its learners: ``popen`` (the script run again per learner) and ``spawn``/``forkserver``."""
