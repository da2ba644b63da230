"""Steps 2 and 3, tokens: train or import the tokenizer (tokenizer), write the corpus as checksummed token shards
(shards), keep them in a folder or an object store (store), and read them back as training windows (loader)."""
