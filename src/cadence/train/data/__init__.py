"""``cadence train --data``: the user's own tokens, read without torch until a rank batches them.

- `cadence.train.data.stream`: `TokenStream`, a sequence of token arrays read as one;
- `cadence.train.data.shards`: token shards (nanoGPT's flat files, llm.c's headered ones);
- `cadence.train.data.text`: text files, the standard library's source, a tokenizer;
- `cadence.train.data.corpus`: ``--data`` resolved and checked: the training and the
  held-out streams, and the vocabulary they need;
- `cadence.train.data.windows`: `TokenWindows`, the batches of each step (torch).

Only `windows` imports torch: the others run in ``cadence train``'s own process,
before any rank starts (`cadence.train.preflight`).
"""
