"""`python -m thinwire.train ARGS...` as a script (its __main__ is a package module, which
tests.integrations.launch.preloaded cannot run by path): what test_faults.py's torchrun
workers run through that preloaded server, forked from it instead of started as new
interpreters (~7 s of CPU each: torch, torch._dynamo and thinwire imported again)."""

from thinwire.train.cli import torchrun_main

if __name__ == "__main__":
    torchrun_main()
