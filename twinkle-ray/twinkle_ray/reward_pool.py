"""Rewards scored in a pool of CPU actors: a slow or crashing reward neither stalls nor kills training.

A recipe wraps any reward (a registered name or ``module:function``) in the ``ray_pool`` reward::

    rewards:
      - name: ray_pool
        options: {reward: my_pkg.judge:score, workers: 2, timeout_s: 30}

Each call splits the completions over ``workers`` actors. A chunk whose actor raises, dies or does not answer
within ``timeout_s`` is scored ``nan`` ("no score": the RL task counts it and scores it as the recipe says) and a
warning names the reward, the actor and the cause; a dead actor is restarted by Ray for the next call. The
actors are named per Ray job, so every trainer rank of a job shares one pool.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.rewards import Reward

logger = logging.getLogger("twinkle.ray")


class RewardWorker:
    """The actor class: loads the reward once, scores chunks."""

    def __init__(self, spec: str, options: dict[str, Any]) -> None:
        from twinkle_core.rewards import load_reward

        self.spec = spec
        self.fn = load_reward(spec, options)

    def ready(self) -> bool:
        return True

    def score(self, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]) -> list[float]:
        try:
            scores = [float(s) for s in self.fn(prompts, completions, **fields)]
        except SystemExit as exc:  # a reward must not end its worker's process through sys.exit
            raise RuntimeError(f"reward {self.spec!r} called sys.exit({exc.code})") from None
        if len(scores) != len(completions):
            raise ValueError(f"reward {self.spec!r} returned {len(scores)} scores for {len(completions)} completions")
        return scores


class RayRewardPool(Reward):
    name = "ray_pool"

    def __init__(self, reward: str, options: dict[str, Any] | None = None, workers: int = 2,
                 timeout_s: float = 60.0, num_cpus: float = 1.0, start_timeout_s: float = 300.0) -> None:
        if not isinstance(reward, str) or not reward:
            raise ConfigError("ray_pool needs the option reward: a registered reward name or 'module:function'")
        if not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"ray_pool option workers must be a positive integer, got {workers!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"ray_pool option timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.spec, self.options = reward, dict(options or {})
        self.workers, self.timeout_s, self.num_cpus = workers, float(timeout_s), num_cpus
        self.start_timeout_s = float(start_timeout_s)
        self.actors: list[Any] = []

    def _pool(self) -> list[Any]:
        if not self.actors:
            from twinkle_ray.cluster import ray_module

            ray = ray_module()
            if not ray.is_initialized():
                raise ConfigError("the ray_pool reward runs on a Ray cluster: train with `twinkle train --runtime "
                                  "ray`, or call ray.init() before training")
            job = ray.get_runtime_context().get_job_id()
            worker = ray.remote(RewardWorker)
            slug = "".join(c if c.isalnum() else "-" for c in self.spec)
            self.actors = [worker.options(name=f"twinkle-reward-{job}-{slug}-{i}", get_if_exists=True,
                                          num_cpus=self.num_cpus, max_restarts=-1, max_task_retries=0)
                           .remote(self.spec, self.options) for i in range(self.workers)]
        return self.actors

    def _wait_ready(self, actors: list[Any]) -> None:
        """Wait for every worker process to be up (started, or restarted after a failure), so that the scoring
        timeout measures the reward, not a worker's start."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        from twinkle_ray.cluster import ray_module

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                ray_module().get([actor.ready.remote() for actor in actors],
                                 timeout=max(0.0, deadline - time.monotonic()))
                return
            except ActorUnavailableError:  # restarting after a failure: ask again until it is up
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            except GetTimeoutError:
                break
            except RayActorError as exc:  # the constructor failed: the reward cannot be loaded
                raise ConfigError(f"reward {self.spec!r} cannot be loaded in a ray_pool worker: "
                                  f"{str(exc).strip().splitlines()[-1]}") from None
        raise ConfigError(f"reward {self.spec!r}: the ray_pool workers did not start within "
                          f"{self.start_timeout_s:.0f} s; the cluster may lack {self.num_cpus} free CPU per worker")

    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        from twinkle_ray.cluster import ray_module

        ray = ray_module()
        actors = self._pool()
        self._wait_ready(actors)  # started, or restarted after the last call's failure
        bounds = chunk_bounds(len(completions), len(actors))
        calls = [(index, actor, b - a, actor.score.remote(prompts[a:b], completions[a:b],
                                                          {k: v[a:b] for k, v in fields.items()}))
                 for index, (actor, (a, b)) in enumerate(zip(actors, bounds)) if b > a]
        futures = [future for *_, future in calls]
        ready, _ = ray.wait(futures, num_returns=len(futures), timeout=self.timeout_s)
        scores: list[float] = []
        for index, actor, size, future in calls:
            scores += self._chunk(ray, actor, future, future in ready, index, size)
        return scores

    def _chunk(self, ray: Any, actor: Any, future: Any, ready: bool, index: int, size: int) -> list[float]:
        from ray.exceptions import RayActorError, RayTaskError

        if not ready:
            ray.kill(actor, no_restart=False)  # a hung call cannot be interrupted; Ray restarts the worker
            logger.warning("reward %r: worker %d gave no scores within %.0f s; %d completions scored nan",
                           self.spec, index, self.timeout_s, size)
            return [math.nan] * size
        try:
            return ray.get(future)
        except RayActorError as exc:
            cause = f"its actor died ({type(exc).__name__})"
        except RayTaskError as exc:
            cause = str(exc.cause) if exc.cause is not None else str(exc).strip().splitlines()[-1]
        logger.warning("reward %r: worker %d failed: %s; %d completions scored nan", self.spec, index, cause, size)
        return [math.nan] * size


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, end)`` ranges covering ``range(total)``, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
