"""A blind side-by-side arena for people: two (or more) Kiln models answer held-out prompts, a person votes, and
Bradley-Terry ratings with bootstrap intervals follow. Run ``kiln arena RELEASE_A RELEASE_B`` and open the URL it prints.

``session`` (rounds, votes, ratings), ``ratings`` (Bradley-Terry, Elo, bootstrap), ``votes`` (the JSONL records),
``contestants`` (a model answering through the KV-cache sampler), ``prompts``, ``tracking`` (MLflow), ``app`` and
``page`` (the web app on 127.0.0.1).
"""
