"""Label log-probabilities and entropies of ``softmax(logits / temperature)``, chunked.

The routine lives in the core, next to the untempered one it shares its chunking with
(:func:`twinkle_core.loss.logprobs.tempered_token_logprobs`); this module keeps the plugin's import path.
"""

from __future__ import annotations

from twinkle_core.loss.logprobs import TokenLogprobs, tempered_token_logprobs

__all__ = ["TokenLogprobs", "tempered_token_logprobs"]
