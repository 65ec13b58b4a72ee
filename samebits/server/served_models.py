"""Which model answers which endpoint: a generation model (completions, chat, responses), an
embedding model (embeddings), or both side by side. Each model answers to its name and to its
aliases (``samebits serve MODEL --served-model-name A B``: A, B and MODEL). A request that names
the wrong kind of model gets a 400 that says what the model is and where to send it; an unknown
name gets a 404 listing the served models. ``GET /v1/models`` lists one card per name (vLLM's
shape: ``root`` is what the model was loaded from).
"""

from __future__ import annotations

from dataclasses import dataclass

from samebits.server.embeddings import EmbeddingContext
from samebits.server.errors import APIError
from samebits.server.protocol import ModelCard
from samebits.server.serving import ServingContext


@dataclass
class ServedModels:
    generation: ServingContext | None
    embedding: EmbeddingContext | None
    embedding_aliases: tuple[str, ...] = ()  # the embedding model's other names

    def __post_init__(self) -> None:
        if self.generation is None and self.embedding is None:
            raise ValueError("a server needs a generation model, an embedding model or both")
        if shared := set(self._gen_names) & set(self._emb_names):
            raise ValueError(f"the generation and the embedding model are both named "
                             f"{sorted(shared)[0]!r}: give them different names")

    @property
    def _gen_name(self) -> str | None:
        return self.generation.model_name if self.generation else None

    @property
    def _emb_name(self) -> str | None:
        return self.embedding.model_name if self.embedding else None

    @property
    def _gen_names(self) -> tuple[str, ...]:
        ctx = self.generation
        return () if ctx is None else (ctx.model_name, *ctx.aliases)

    @property
    def _emb_names(self) -> tuple[str, ...]:
        svc = self.embedding
        return () if svc is None else (svc.model_name, *self.embedding_aliases)

    @property
    def fingerprint(self) -> str:
        """The server's fingerprint: the generation model's, else the embedding model's."""
        if self.generation is not None:
            return self.generation.fingerprint
        assert self.embedding is not None
        return self.embedding.fingerprint

    def cards(self) -> list[ModelCard]:
        """One card per served name, the generation model's first."""
        cards = []
        if (ctx := self.generation) is not None:
            root = ctx.engine.engine.config.model or ctx.model_name
            cards += [ModelCard(id=name, root=root, max_model_len=ctx.max_model_len,
                                system_fingerprint=ctx.fingerprint) for name in self._gen_names]
        if (svc := self.embedding) is not None:
            root = svc.engine.engine.config.model or svc.model_name
            cards += [ModelCard(id=name, root=root, max_model_len=svc.max_len,
                                system_fingerprint=svc.fingerprint, task="embed")
                      for name in self._emb_names]
        return cards

    def card(self, name: str) -> ModelCard:
        """``GET /v1/models/{name}``: the card of a served name, else a 404."""
        for card in self.cards():
            if card.id == name:
                return card
        raise self._not_found(name)

    def for_generation(self, name: str | None, endpoint: str) -> ServingContext:
        """The generation model a completions or chat request names (None: the served one)."""
        if name is not None and name in self._emb_names:
            raise self._embedding_model(name, endpoint)
        if self.generation is None:
            if name is None:
                raise self._embedding_model(self._emb_name, endpoint)
            raise self._not_found(name)
        if name is not None and name not in self._gen_names:
            raise self._not_found(name)
        return self.generation

    def for_embedding(self, name: str | None) -> EmbeddingContext:
        """The embedding model an embeddings request names (None: the served one)."""
        if name is not None and name in self._gen_names:
            raise self._generation_model(name)
        if self.embedding is None:
            if name is None:
                raise self._generation_model(self._gen_name)
            raise self._not_found(name)
        if name is not None and name not in self._emb_names:
            raise self._not_found(name)
        return self.embedding

    def _embedding_model(self, name: str | None, endpoint: str) -> APIError:
        hint = (f"; for {endpoint} use {self._gen_name!r}" if self.generation is not None
                else "; this server serves no generation model")
        return APIError(400, f"the model {name!r} is an embedding model: it has no {endpoint}; "
                        f"send it to POST /v1/embeddings{hint}", param="model",
                        code="model_not_supported")

    def _generation_model(self, name: str | None) -> APIError:
        hint = (f"; for embeddings use {self._emb_name!r}" if self.embedding is not None
                else "; this server serves no embedding model (start it with --embed-model, or "
                "--task embed)")
        return APIError(400, f"the model {name!r} is a generation model, not an embedding "
                        f"model{hint}", param="model", code="model_not_supported")

    def _not_found(self, name: str) -> APIError:
        served = ", ".join(repr(n) for n in (*self._gen_names, *self._emb_names))
        return APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                        param="model", code="model_not_found")
