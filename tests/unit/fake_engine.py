"""A model-free engine for scheduler tests.

Its "KV pool" stores the token id of each position at the slot the scheduler chose, and its
next token is a hash of the token ids it reads back through the page table. Any page-table or
slot mistake (a freed page reused while still read, a wrong repoint, a missed write) changes
the outputs, so comparing against a request run alone checks the whole cache path.
"""

from __future__ import annotations

import torch

from minisgl.engine.batch import Batch, BatchOutput

EMPTY = -1


class FakeEngine:
    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        max_seq_len: int = 4096,
        vocab: int = 97,
        eos: int = 0,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.vocab = vocab
        self.eos_token_ids = frozenset({eos})
        self.pool = torch.full((num_pages * page_size,), EMPTY, dtype=torch.int64)
        self.forward_calls = 0
        self.batch_sizes: list[int] = []
        self.extend_tokens = 0

    def forward(self, batch: Batch) -> BatchOutput:
        self.forward_calls += 1
        self.batch_sizes.append(batch.size)
        ids = torch.tensor(batch.input_ids, dtype=torch.int64)
        assert batch.out_loc.numel() == ids.numel()
        assert len(set(batch.out_loc.tolist())) == ids.numel(), "two tokens share a slot"
        self.pool[batch.out_loc] = ids
        self.extend_tokens += ids.numel()
        out: list[int] = []
        for i, info in enumerate(batch.sample):
            row, n = batch.table_idx[i], batch.device_len[i]
            slots = batch.page_table[row, :n].to(torch.int64)
            tokens = self.pool[slots].tolist()
            assert EMPTY not in tokens, "read a slot that was never written"
            if info is None:
                continue
            expected = list(info.prompt_ids) + list(info.output_ids)
            assert tokens == expected, "KV read back differs from the request's tokens"
            h = 7
            for t in tokens:
                h = (h * 1_000_003 + t) % 2_147_483_647
            token = h % self.vocab
            banned = getattr(info, "banned_token_ids", frozenset())
            while token in banned:
                token = (token + 1) % self.vocab
            out.append(token)
        return BatchOutput(next_token_ids=out)
