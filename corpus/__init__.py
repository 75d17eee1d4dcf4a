"""A corpus turned into token shards a run trains from: reading the field's formats (sources.py),
tokenizers (tokenizers.py), preparation (prepare.py) and the manifest that describes the result
(manifest.py)."""
