"""Logits processors applied to a step's final logits before sampling: grammar masks
(structured output, through llguidance) and min_tokens, as vLLM V1 applies them.

A request's grammar state lives here, keyed by the runner's request object, and catches up
with the tokens the request holds, so a preempted request that is recomputed, or one resumed
from the journal, is constrained from where it was."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch
from tokenizers import pre_tokenizers

from engine.config import SamplingParams
from engine.core.runner_requests import RunnerRequest
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BITS = torch.arange(32, dtype=torch.int32)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer: each id's bytes, the EOS ids."""
    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        try:  # byte-level and byte-fallback tokenizers: llguidance reads tokenizer.json
            return llguidance.LLTokenizer(_plain_added_tokens(tokenizer.to_str()),
                                          n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # others (a Metaspace decoder alone): each piece's text
            return llguidance.LLTokenizer(_PieceVocabulary(tokenizer, vocab_size),
                                          n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(_ByteVocabulary(tokenizer, vocab_size),
                                      n_vocab=vocab_size, eos_token=eos)
    raise TypeError(f"no grammar vocabulary for {type(tokenizer).__name__}")


def _plain_added_tokens(tokenizer_json: str) -> str:
    """tokenizer.json with a byte-level BPE's non-special added tokens (Hermes's
    `<tool_call>`) moved into its vocabulary. llguidance takes every added token as special,
    then refuses the very token its own forced-text path chose when a grammar spells one."""
    data = json.loads(tokenizer_json)
    model, added = data.get("model") or {}, data.get("added_tokens") or []
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel" \
            or all(token["special"] for token in added):
        return tokenizer_json
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = model["vocab"]
    kept = []
    for token in added:
        piece = "".join(part for part, _ in spell.pre_tokenize_str(token["content"]))
        if token["special"] or vocab.setdefault(piece, token["id"]) != token["id"]:
            kept.append(token)  # a piece the vocabulary already has stays an added token
    data["added_tokens"] = kept
    return json.dumps(data)


class _PieceVocabulary:
    """llguidance's TokenizerWrapper from a tokenizer's pieces: SentencePiece's "▁" is a space,
    "<0xAB>" a byte; special tokens and ids past the vocabulary are special."""

    def __init__(self, tokenizer: HFTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.bos_token_id = None
        special = tokenizer.special_ids()
        self.tokens = [_piece_bytes(tokenizer.piece(i)) if i not in special
                       and tokenizer.piece(i) is not None else f"<|special_{i}|>".encode()
                       for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in range(vocab_size)
                                        if i in special or tokenizer.piece(i) is None)
        self.is_tokenizer_wrapper = True
        self._ids = {token: i for i, token in enumerate(self.tokens)
                     if i not in self.special_token_ids}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """The longest pieces that spell `text`, left to right (the model's own tokenizer
        reads a leading space as "▁▁", so llguidance is given pieces it can trust)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                token = self._ids.get(data[at:end])
                if token is not None:
                    ids.append(token)
                    at = end
                    break
            else:
                at += 1  # a byte no piece spells: the grammar cannot reach it either
        return ids


def _piece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode("utf-8")


class _ByteVocabulary:
    """llguidance's TokenizerWrapper for the byte tokenizer: ids past the bytes are special."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        offset = tokenizer.OFFSET
        self.eos_token_id = tokenizer.EOS
        self.bos_token_id = tokenizer.BOS
        self.tokens = [bytes([i - offset]) if offset <= i < 256 + offset
                       else f"<|special_{i}|>".encode() for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size)
                                  if not offset <= i < 256 + offset]
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            return [b + self._tokenizer.OFFSET for b in text]
        return self._tokenizer.encode(text)


@dataclass
class _Tracked:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens fed to the matcher so far


# the rows a grammar constrains, and the rows that ask for min_tokens
ProcessedRows = tuple[tuple[int, ...], tuple[int, ...]]


def grammar_masks(params: SamplingParams) -> bool:
    """Whether a grammar masks this request's logits."""
    return params.structured_output is not None and not params.prefill_only


def holds_back(params: SamplingParams) -> bool:
    """Whether min_tokens may hold back this request's stop tokens."""
    return bool(params.min_tokens)


def processed_rows(requests: Sequence[RunnerRequest]) -> ProcessedRows:
    """Which rows the processors may touch: fixed by the requests' parameters."""
    return (tuple(row for row, r in enumerate(requests) if grammar_masks(r.params)),
            tuple(row for row, r in enumerate(requests) if holds_back(r.params)))


class LogitsProcessors:
    """The grammar masks and min_tokens of one model's requests, applied a step at a time."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._vocabulary: llguidance.LLTokenizer | None = None  # built at the first grammar
        self._executor: llguidance.LLExecutor | None = None
        self._tracked: weakref.WeakKeyDictionary[RunnerRequest, _Tracked] = (
            weakref.WeakKeyDictionary())

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        if self._vocabulary is None:
            self._vocabulary = grammar_tokenizer(self.tokenizer, self.vocab_size)
        return self._vocabulary

    def apply(self, logits: torch.Tensor, requests: Sequence[RunnerRequest],
              rows: ProcessedRows | None = None) -> dict[str, str]:
        """Set disallowed tokens of `logits` [M, V] (row i for `requests[i]`) to -inf, in
        place; return the requests whose grammar failed, with why (their rows stay, unread).
        `rows`: processed_rows(requests), where the caller keeps it already."""
        grammar_rows, min_tokens_rows = processed_rows(requests) if rows is None else rows
        refused: dict[str, str] = {}
        constrained = []
        for row in grammar_rows:
            request = requests[row]
            try:
                constrained.append((row, request, self._matcher(request)))
            except Exception as exc:  # this request's grammar alone
                refused[request.id] = f"structured output failed: {type(exc).__name__}: {exc}"
        if constrained:
            self._mask_grammar(logits, constrained)
            for _, request, matcher in constrained:  # e.g. a forced text no token spells
                if matcher.is_error():
                    reason = (matcher.get_error().splitlines() or ["unknown"])[0]  # no dump
                    refused[request.id] = f"structured output failed: {reason}"
        for row in min_tokens_rows:
            request = requests[row]
            params = request.params
            if len(request.output_token_ids) < params.min_tokens:
                stops = {*params.stop_token_ids,
                         *(() if params.ignore_eos else self.eos_token_ids)}
                logits[row, [t for t in stops if t < logits.shape[-1]]] = float("-inf")
        return refused

    def _mask_grammar(self, logits: torch.Tensor,
                      constrained: list[tuple[int, RunnerRequest, llguidance.LLMatcher]]
                      ) -> None:
        """One bitmask for every constrained row, filled in parallel, applied as one mask."""
        matchers = [matcher for _, _, matcher in constrained]
        vocab = logits.shape[-1]
        bitmask = torch.zeros((len(constrained), (vocab + 31) // 32), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(matcher, i) for i, matcher in enumerate(matchers)], bitmask.data_ptr(),
            bitmask.shape[1] * 4, len(constrained))
        allowed = ((bitmask.unsqueeze(-1) >> BITS) & 1).flatten(1)[:, :vocab].bool()
        rows = torch.tensor([row for row, _, _ in constrained], dtype=torch.int64)
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))

    def _matcher(self, request: RunnerRequest) -> llguidance.LLMatcher:
        tracked = self._tracked.get(request)
        if tracked is None:
            grammar = request.params.structured_output
            assert grammar is not None
            tracked = self._tracked[request] = _Tracked(
                llguidance.LLMatcher(self.vocabulary, grammar))
        output = request.output_token_ids
        if tracked.consumed < len(output):  # the tokens sampled since (or before a recompute)
            tracked.matcher.consume_tokens(output[tracked.consumed:])
            tracked.consumed = len(output)
        return tracked.matcher


def check_grammar(grammar: str) -> str | None:
    """Why llguidance refuses `grammar`, or None."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error or None
