"""`python -m tests.support.zygote_probe CODE`: runs the Python statement CODE (for
tests/unit/test_node_zygote.py, which runs it forked from the node zygote)."""

import sys

if __name__ == "__main__":
    exec(sys.argv[1])
