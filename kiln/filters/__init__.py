"""Step 1b, quality filters: each filter keeps a document or drops it with a reason; kiln.filters.registry lists them.

One module per family (gopher_quality, gopher_repetition, c4, fineweb, olmo2, dirty_words, url, language) on top of
kiln.filters.base; ``python -m kiln.filters FILE`` shows every signal of one file and the first rule that drops it.
"""
