"""dflash: train DFlash speculative-decoding drafters from a cached hidden-state store.

`pipeline` holds the library: configs, the store schema, the target wrapper, the drafter and its loss.
`stages` holds the long-running jobs (extract, train, eval) built on it; `data` holds ingest and assets.
"""

__version__ = "0.1.0"
