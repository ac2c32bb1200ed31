"""The ``embedding`` task: contrastive training of text embedding models.

Recipe ``task_options`` (all optional):

* ``pooling``: ``auto`` (default), ``mean``, ``cls`` or ``last_token``. ``auto`` reads the model
  directory's sentence-transformers config (``modules.json`` + ``1_Pooling/config.json``); without
  one it is ``mean`` for encoders (BERT family) and ``last_token`` for decoders (Qwen3 ...).
* ``normalize``: ``auto`` (default: the directory's ``Normalize`` module, else ``true``), ``true``
  or ``false``: L2-normalise the embeddings.
* ``max_length``: truncate texts to this many tokens (default: ``data.max_length``, else the
  directory's ``max_seq_length``, else the tokenizer's limit).
* ``query_prefix`` / ``document_prefix``: text put in front of every query / document (E5-style
  ``"query: "``); default: the directory's sentence-transformers prompts, else none.
* ``instruction``: an instruction for every query without its own; ``instruction_template``
  (default ``"Instruct: {instruction}\\nQuery: {query}"``, Qwen3-Embedding's) renders it. A row's
  ``instruction`` field wins over the option.
* ``model_kind``: ``encoder`` (default; the HF backend builds ``AutoModel``: BERT-family encoders
  and the bare Qwen3 decoder alike) or ``causal_lm`` (the model with its LM head; the last hidden
  state is pooled).
* ``pad_to_multiple_of``: pad batch lengths to a multiple.

``evaluate_options`` (``train.evaluate_options`` in a recipe): ``k`` (recall cut-offs, default
``[1, 5, 10]``), ``batch_size`` (default 64), ``corpus`` (a JSONL file of ``{"text": ...}`` rows
added to the corpus), ``data`` (the held-out rows, when the recipe has no ``data.eval``).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Sequence
from typing import Any

from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.task import Task
from twinkle_embedding.data import EmbeddingFeature, RowError, collate_embedding, read_rows, validate_row
from twinkle_embedding.head import EmbeddingHead
from twinkle_embedding.pooling import canonical_pooling
from twinkle_embedding.st_format import (
    SentenceTransformersConfig,
    read_sentence_transformers_config,
    write_sentence_transformers_config,
)

logger = logging.getLogger("twinkle.embedding")

DEFAULT_INSTRUCTION_TEMPLATE = "Instruct: {instruction}\nQuery: {query}"
_OPTIONS = {
    "pooling": "auto",
    "normalize": "auto",
    "max_length": None,
    "query_prefix": "",
    "document_prefix": "",
    "instruction": None,
    "instruction_template": DEFAULT_INSTRUCTION_TEMPLATE,
    "model_kind": "encoder",
    "pad_to_multiple_of": None,
}
_EVALUATE_OPTIONS = ("k", "batch_size", "corpus", "data")
#: larger ``model_max_length`` values are transformers' "no limit" placeholder
_NO_LIMIT = 1_000_000


def _unknown(keys: Sequence[str], known: Sequence[str], where: str) -> ConfigError:
    parts = []
    for key in sorted(keys):
        close = difflib.get_close_matches(str(key), list(known), n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigError(f"{where}: unknown option(s) {', '.join(parts)}; known: {', '.join(known)}")


def _directory_of(obj: Any) -> str | None:
    for attr in ("model_path", "model_id", "name_or_path"):
        value = getattr(obj, attr, None)
        if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
            return os.fspath(value)
    return None


def _network(model: Any) -> Any:
    """The model's network (``TwinkleModel.network``), or ``None`` for a model that declares none (a stand-in
    that only calls the task's hooks): the task then reads no config and freezes nothing."""
    try:
        return model.network
    except (AttributeError, ConfigError):
        return None


class EmbeddingTask(Task):
    name = "embedding"
    default_loss = "infonce"
    model_kind = "encoder"

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise _unknown(sorted(unknown), list(_OPTIONS), "task_options")
        super().__init__(**options)
        self.explicit = set(options)
        merged = {**_OPTIONS, **options}
        self.pooling_option = merged["pooling"]
        if self.pooling_option != "auto":
            self.pooling_option = canonical_pooling(self.pooling_option, key="task_options.pooling")
        if merged["normalize"] not in ("auto", True, False):
            raise ConfigError(f"task_options.normalize must be auto, true or false, got {merged['normalize']!r}")
        self.normalize_option = merged["normalize"]
        if merged["model_kind"] not in ("encoder", "causal_lm"):
            raise ConfigError(f"task_options.model_kind must be 'encoder' or 'causal_lm', got {merged['model_kind']!r}")
        self.model_kind = merged["model_kind"]  # read by the backend when it builds the network
        for key in ("query_prefix", "document_prefix", "instruction_template"):
            if not isinstance(merged[key], str):
                raise ConfigError(f"task_options.{key} must be a string, got {merged[key]!r}")
        if "{query}" not in merged["instruction_template"]:
            raise ConfigError("task_options.instruction_template must contain {query} (and usually {instruction})")
        if merged["instruction"] is not None and not isinstance(merged["instruction"], str):
            raise ConfigError(f"task_options.instruction must be a string, got {merged['instruction']!r}")
        self.query_prefix = merged["query_prefix"]
        self.document_prefix = merged["document_prefix"]
        self.instruction = merged["instruction"]
        self.instruction_template = merged["instruction_template"]
        self.max_length = merged["max_length"]
        self.pad_to_multiple_of = merged["pad_to_multiple_of"]
        self.do_lower_case = False
        self.tokenizer: Any = None
        self.pad_token_id = 0
        self.padding_side = "right"
        self.pooling: str | None = None if self.pooling_option == "auto" else self.pooling_option
        self.normalize: bool | None = None if self.normalize_option == "auto" else bool(self.normalize_option)
        self.st_config: SentenceTransformersConfig | None = None
        self.head: EmbeddingHead | None = None  # built by prepare_model, applied by process_outputs

    # ------------------------------------------------------------------ sentence-transformers directories
    def _adopt(self, config: SentenceTransformersConfig | None) -> None:
        """Take the defaults the user did not set from a sentence-transformers directory."""
        if config is None:
            return
        self.st_config = config
        if "max_length" not in self.explicit and config.max_seq_length is not None:
            self.max_length = config.max_seq_length
        self.do_lower_case = config.do_lower_case
        if "query_prefix" not in self.explicit and "query" in config.prompts:
            self.query_prefix = config.prompts["query"]
        for name in ("document", "passage", "corpus"):
            if "document_prefix" not in self.explicit and name in config.prompts:
                self.document_prefix = config.prompts[name]
                break

    # ------------------------------------------------------------------ text
    def format_query(self, query: str, instruction: str | None = None) -> str:
        instruction = instruction if instruction is not None else self.instruction
        text = (self.instruction_template.format(instruction=instruction, query=query) if instruction
                else self.query_prefix + query)
        return text.lower() if self.do_lower_case else text

    def format_document(self, text: str) -> str:
        text = self.document_prefix + text
        return text.lower() if self.do_lower_case else text

    def _setup_tokenizer(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ConfigError("the embedding task needs a tokenizer")
        self.tokenizer = tokenizer
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.padding_side = getattr(tokenizer, "padding_side", "right") or "right"
        if self.max_length is None:
            limit = getattr(tokenizer, "model_max_length", None)
            if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
                self.max_length = limit

    def tokenize(self, texts: Sequence[str], tokenizer: Any = None) -> list[list[int]]:
        tokenizer = tokenizer or self.tokenizer
        if not texts:
            return []
        kwargs: dict[str, Any] = {"add_special_tokens": True}
        if self.max_length is not None:
            kwargs.update(truncation=True, max_length=int(self.max_length))
        return [list(ids) for ids in tokenizer(list(texts), **kwargs)["input_ids"]]

    # ------------------------------------------------------------------ data
    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None,
                     **data_options: Any) -> list[EmbeddingFeature]:
        """Read rows (a .jsonl/.json/.parquet/.csv file or a list of dicts) into tokenised features."""
        if data_options:
            raise _unknown(sorted(data_options), ["max_length"], "data options of the embedding task")
        if self.tokenizer is None:
            self._adopt(read_sentence_transformers_config(_directory_of(tokenizer)))
        if max_length is not None:
            self.max_length = int(max_length)
            self.explicit.add("max_length")
        self._setup_tokenizer(tokenizer)
        source, records = read_rows(path)
        parsed = []
        for line, row in records:
            try:
                query, positive, negatives, instruction = validate_row(row)
            except RowError as exc:
                raise DataFormatError(source, line, str(exc)) from None
            parsed.append((line, self.format_query(query, instruction), self.format_document(positive),
                           [self.format_document(n) for n in negatives]))
        if not parsed:
            raise DataFormatError(source, None, "no rows: expected JSONL rows like "
                                                '{"query": ..., "positive": ..., "negatives": [...]}')
        texts = [t for _, q, p, negs in parsed for t in (q, p, *negs)]
        ids = iter(self.tokenize(texts))
        features = []
        for line, query, positive, negatives in parsed:
            features.append(EmbeddingFeature(query=next(ids), positive=next(ids),
                                             negatives=[next(ids) for _ in negatives], query_text=query,
                                             positive_text=positive, negative_texts=list(negatives), line=line))
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return collate_embedding(features, self.pad_token_id, self.padding_side, self.pad_to_multiple_of)

    # ------------------------------------------------------------------ model
    def _default_pooling(self, model: Any) -> str:
        config = getattr(_network(model), "config", None)
        model_type = getattr(config, "model_type", None)
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
        except ImportError:  # pragma: no cover - the HF backend brings transformers
            MODEL_FOR_MASKED_LM_MAPPING_NAMES = {}
        if model_type is not None and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            return "last_token"
        return "mean"

    def _require_built_with_this_task(self, model: Any) -> None:
        # The model reaches the task only through its own ``task`` (process_outputs on every forward,
        # on_export on every save): a model built without it would return no embeddings.
        if getattr(model, "task", None) is not self:
            raise ConfigError(f"the embedding task works through the model's task hooks, but {type(model).__name__} "
                              f"was built with task={getattr(model, 'task', None)!r}; pass task=<this EmbeddingTask> "
                              f"when constructing the model (twinkle train does)")

    def prepare_model(self, model: Any) -> None:
        """Choose the pooling and normalisation (from the model directory's sentence-transformers config when
        it has one) and freeze the parts of the network the embedding does not use."""
        import torch

        self._require_built_with_this_task(model)
        config = read_sentence_transformers_config(_directory_of(model))
        if config is not None:
            self._adopt(config)
        st = self.st_config
        if self.pooling is None:
            self.pooling = st.pooling if st is not None and st.pooling else self._default_pooling(model)
        if self.normalize is None:
            self.normalize = st.normalize if st is not None else True
        network = _network(model)
        if network is not None:
            pooler = getattr(network, "pooler", None)
            if isinstance(pooler, torch.nn.Module):
                # BERT's pooler (a dense layer on [CLS]) is not part of the sentence embedding: keep it frozen
                for parameter in pooler.parameters():
                    parameter.requires_grad_(False)
            if self.model_kind == "causal_lm" and getattr(network, "config", None) is not None:
                network.config.output_hidden_states = True
        self.head = EmbeddingHead(self.pooling, self.normalize)
        logger.info("embedding task: pooling=%s normalize=%s max_length=%s", self.pooling, self.normalize,
                    self.max_length)

    def _prompts(self) -> dict[str, str]:
        prompts = {}
        query_prefix = self.query_prefix
        if self.instruction:
            marker = "\x00"
            rendered = self.instruction_template.format(instruction=self.instruction, query=marker)
            head, _, tail = rendered.partition(marker)
            if tail:
                logger.warning("instruction_template puts text after {query}; sentence-transformers prompts can only "
                               "prefix, so the saved model has no query prompt")
                query_prefix = ""
            else:
                query_prefix = head
        if query_prefix:
            prompts["query"] = query_prefix
        if self.document_prefix:
            prompts["document"] = self.document_prefix
        return prompts

    def process_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """Pool (and normalise) the network's token states into ``{"embeddings": [batch, dim]}``."""
        if self.head is None:
            raise ConfigError("the embedding task has no pooling yet: call task.prepare_model(model) once the model "
                              "is built (twinkle train does)")
        return self.head(outputs, inputs)

    def on_export(self, model: Any, directory: str, adapter_name: str | None) -> None:
        """Make the model directory just written a sentence-transformers directory."""
        dimension = self.head.dimension if self.head is not None else None
        config = getattr(_network(model), "config", None)
        if dimension is None:
            dimension = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
        if dimension is None:
            logger.warning("embedding task: unknown embedding dimension; %s gets no sentence-transformers files",
                           directory)
            return
        write_sentence_transformers_config(
            directory, pooling=self.pooling or "mean", normalize=bool(self.normalize), dimension=int(dimension),
            max_seq_length=self.max_length, do_lower_case=self.do_lower_case, prompts=self._prompts(),
            similarity_fn_name="cosine")

    # ------------------------------------------------------------------ encoding and evaluation
    def encode(self, model: Any, texts: Sequence[str], *, batch_size: int = 64, tokenizer: Any = None) -> Any:
        """Embeddings ``[len(texts), dim]`` (float32, CPU) of already formatted texts, through ``model.forward_only``."""
        import torch

        self._require_built_with_this_task(model)
        if self.head is None:
            raise ConfigError("encode needs a model prepared by the embedding task (task.prepare_model(model))")
        tokenizer = tokenizer or self.tokenizer or getattr(model, "tokenizer", None)
        if self.tokenizer is None:
            self._setup_tokenizer(tokenizer)
        from twinkle_embedding.data import pad_batch

        chunks = []
        for start in range(0, len(texts), batch_size):
            ids = self.tokenize(texts[start:start + batch_size], tokenizer)
            input_ids, attention_mask = pad_batch(ids, self.pad_token_id, self.padding_side, self.pad_to_multiple_of)
            outputs = model.forward_only(inputs={"input_ids": input_ids, "attention_mask": attention_mask})
            chunks.append(outputs["embeddings"].detach().float().cpu())
        if not chunks:
            return torch.zeros((0, 0))
        return torch.cat(chunks, dim=0)

    def encode_queries(self, model: Any, queries: Sequence[str], *, instruction: str | None = None,
                       batch_size: int = 64) -> Any:
        return self.encode(model, [self.format_query(q, instruction) for q in queries], batch_size=batch_size)

    def encode_documents(self, model: Any, documents: Sequence[str], *, batch_size: int = 64) -> Any:
        return self.encode(model, [self.format_document(d) for d in documents], batch_size=batch_size)

    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, **options: Any) -> dict[str, float]:
        """recall@k and MRR@10 of the held-out queries against the corpus of their documents.

        The corpus is every positive and negative of ``dataset`` (plus ``corpus``, a JSONL file of
        ``{"text": ...}`` rows); a query's relevant documents are its positives. Every rank computes the
        same metrics.
        """
        import torch

        from twinkle_embedding.metrics import retrieval_metrics

        unknown = set(options) - set(_EVALUATE_OPTIONS)
        if unknown:
            raise _unknown(sorted(unknown), list(_EVALUATE_OPTIONS), "evaluate_options")
        ks = options.get("k", (1, 5, 10))
        ks = [int(ks)] if isinstance(ks, int) else [int(k) for k in ks]
        batch_size = int(options.get("batch_size", 64))
        if options.get("data") is not None:
            dataset = self.load_dataset(options["data"], tokenizer)
        if not dataset:
            raise ConfigError("evaluate: no held-out rows; set data.eval (or evaluate_options.data)")
        corpus: list[str] = []
        index: dict[str, int] = {}

        def add(text: str) -> int:
            if text not in index:
                index[text] = len(corpus)
                corpus.append(text)
            return index[text]

        relevant_of: dict[str, set[int]] = {}
        for feature in dataset:
            relevant_of.setdefault(feature.query_text, set()).add(add(feature.positive_text))
            for negative in feature.negative_texts:
                add(negative)
        if options.get("corpus"):
            source, records = read_rows(options["corpus"])
            for line, row in records:
                text = row.get("text") if isinstance(row, dict) else row
                if not isinstance(text, str) or not text.strip():
                    raise DataFormatError(source, line, "a corpus row must be {\"text\": \"...\"} (a non-empty string)")
                add(self.format_document(text))
        queries = list(relevant_of)
        q = self.encode(model, queries, batch_size=batch_size, tokenizer=tokenizer)
        d = self.encode(model, corpus, batch_size=batch_size, tokenizer=tokenizer)
        scores = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T
        metrics = retrieval_metrics(scores, [relevant_of[text] for text in queries], ks=ks, mrr_at=10)
        metrics["num_queries"] = float(len(queries))
        metrics["corpus_size"] = float(len(corpus))
        from twinkle_core import distributed

        if distributed.is_main_process():  # the loop prints only the evaluation after training; say it every time
            shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "@" in k)
            logger.info("retrieval on %d held-out queries / %d documents: %s", len(queries), len(corpus), shown)
        return metrics
