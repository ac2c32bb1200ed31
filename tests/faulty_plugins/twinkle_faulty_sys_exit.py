"""Calls ``sys.exit`` while being imported (SystemExit is a BaseException, not an Exception)."""

import sys

sys.exit("twinkle_faulty_sys_exit refuses to be imported")
