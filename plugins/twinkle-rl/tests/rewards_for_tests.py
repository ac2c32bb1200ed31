"""Reward functions the online-RL tests name as ``rewards_for_tests:<function>`` (conftest.py puts this folder on
``sys.path``); each is a plain ``(prompts, completions, **fields)`` function."""

from __future__ import annotations

import math


def x_share(prompts, completions, **fields):
    """The share of the completion's characters that are ``x``: dense, so a tiny model learns it fast."""
    return [c.count("x") / max(len(c), 1) for c in completions]


def always_one(prompts, completions, **fields):
    return [1.0] * len(completions)


def raises(prompts, completions, **fields):
    raise ValueError("the grader is down")


def nan_for_odd(prompts, completions, **fields):
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]


def one_short(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)


def first_char_parity(prompts, completions, **fields):
    """0 or 1 by the parity of the first character: varies within every group, so every step moves the policy."""
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]


def exits(prompts, completions, **fields):
    """A grader script's ``sys.exit`` called from inside a reward."""
    import sys

    sys.exit(2)


def huge(prompts, completions, **fields):
    """Finite scores whose group std overflows float64 (and whose Dr. GRPO advantages overflow float32)."""
    return [1e308 if c and ord(c[0]) % 2 else -1e308 for c in completions]


def nan_for_first_prompt(prompts, completions, **fields):
    """No score (nan) for every completion of the first prompt of the batch, 0/1 by parity for the others."""
    first = prompts[0]
    return [math.nan if p == first else float(ord(c[0]) % 2) if c else 0.0 for p, c in zip(prompts, completions)]
