"""Step 1b, quality filters: each filter keeps a document or drops it with a reason; the registry lists them."""
