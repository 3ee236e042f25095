"""The KV connector: a request's prefix KV blocks handed from one engine to another
(prefill/decode disaggregation, actors/disaggregated.py), keyed by the block-hash chain the
prefix cache already uses. blocks.py moves the bytes of a worker's blocks; handoff.py is what
crosses between engines."""
