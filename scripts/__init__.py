"""Starting the stack: run-stack.sh for people (`make run`), stack.py for the tests and benchmarks."""
