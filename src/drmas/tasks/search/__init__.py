"""The search task: questions, a passage corpus, retrieval and the exact-match reward.

One module per reason to change, each importing only those above it in this list:

- ``retrieval``: what a retrieval method is (``IndexMethod``, ``SearchIndex``), any
  method's index cached in the store, and BM25: its tokenisation and ``Retriever``;
- ``world``: the generated world of ``generated:facts`` (its corpus, questions, and the
  queries that answer them, for the warm start);
- ``corpus``: the corpus and question files a config names, and the corpus hash;
- ``answers``: Search-R1's exact match, the reward;
- ``client``: the retrieval service's client (``task.retrieval_url``);
- ``dense``: dense retrieval as the reference's (an e5-style encoder, a FAISS flat index),
  which alone imports torch, transformers and faiss, when it runs;
- ``task``: ``SearchTask`` and ``SearchOrchestra`` (``drmas.registry`` names them), and
  the warm start's demonstrations;
- ``service``: the retrieval service, an HTTP server and its command line
  (``drmas serve-retrieval``), which nothing above imports.

This package imports none of them, so that a module that needs only one (the command line
catching the client's errors) does not load bm25s.
"""
