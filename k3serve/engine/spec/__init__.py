"""Speculative decoding: drafts from the request's own text, verified by the target model in one forward,
with the KDA recurrent and short-conv state of rejected drafts rolled back (``rollback``)."""
