"""Rewards that misbehave on purpose, for testing the ``ray_pool`` reward (importable by Ray's workers)."""

from __future__ import annotations

import os
import sys
import time


def length_reward(prompts, completions, **fields):
    return [float(len(c)) for c in completions]


def slow_on_marker(prompts, completions, **fields):
    """Hangs on a completion that contains ``SLOW``."""
    if any("SLOW" in c for c in completions):
        time.sleep(600)
    return length_reward(prompts, completions)


def dies_on_marker(prompts, completions, **fields):
    """Kills its own process on a completion that contains ``DIE``."""
    if any("DIE" in c for c in completions):
        os._exit(9)
    return length_reward(prompts, completions)


def exits_on_marker(prompts, completions, **fields):
    """Calls ``sys.exit`` on a completion that contains ``EXIT``."""
    if any("EXIT" in c for c in completions):
        sys.exit(3)
    return length_reward(prompts, completions)


def worker_pid(prompts, completions, **fields):
    return [float(os.getpid())] * len(completions)
