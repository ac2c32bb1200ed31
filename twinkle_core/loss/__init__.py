"""Losses built into the core. Import concrete losses from their modules (they need torch).

Every loss returns ``LossOutput(loss=<sum over units>, num_tokens=<number of units>)``; the model
divides the accumulated gradients by the global ``num_tokens``. Registered names:

==========================  =====================================================  ==============
name                        class                                                  unit
==========================  =====================================================  ==============
``cross_entropy``           ``twinkle_core.loss.cross_entropy:CrossEntropyLoss``        label token
``chunked_cross_entropy``   ``twinkle_core.loss.cross_entropy:ChunkedCrossEntropyLoss`` label token
``gkd``                     ``twinkle_core.loss.gkd:GKDLoss``                           label token
``mse``                     ``twinkle_core.loss.mse:MSELoss``                           element
==========================  =====================================================  ==============

The RL losses live in the ``twinkle-rl`` plugin (``pip install twinkle-rl``), not in the core: the preference
losses (``dpo``, ``simpo``, ``orpo``, with the ``preference`` task whose batch layout they read) and the
clipped policy-gradient losses (``grpo``, ``dapo``, ``dr_grpo``, ``gspo``, ``ppo``) with PPO's value loss
(``ppo_value``).

``reduction="mean"`` (cross entropy, MSE) returns the mean with ``num_tokens=1``. Per-token
log-probabilities of the labels, with the shared shift convention and bounded memory, at any sampling
temperature, come from :func:`twinkle_core.loss.logprobs.token_logprobs` (with entropies:
:func:`~twinkle_core.loss.logprobs.tempered_token_logprobs`). Labels equal to
:data:`twinkle_core.constants.IGNORE_INDEX` are not scored. A plugin's loss checks its inputs with the
helpers the built-in ones use (:mod:`twinkle_core.loss.helpers`).

Under tensor parallelism a backend may hand the losses only this rank's vocabulary slice of the logits
(``LossContext.vocab_shard``, Megatron by default): cross entropy, the log-prob functions (so the RL losses) and
token accuracy then reduce across the ranks (:mod:`twinkle_core.loss.vocab_parallel`); ``gkd`` and the fused LM
head refuse it with a ``ConfigError`` naming the option that turns it off.
"""

from twinkle_core.loss.base import CallableLoss, Loss, LossContext, LossOutput

__all__ = ["CallableLoss", "Loss", "LossContext", "LossOutput"]
