"""A clickstream (`user`, `page`, `clicked_at`) with two sparkpoint pipelines of its own operators."""
