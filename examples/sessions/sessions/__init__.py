"""A clickstream delivered at least once (`event_id`, `user`, `page`, `clicked_at`), late and out of
order, with two event-time operators: `sessions` (list state and event-time timers) and
`first_clicks` (deduplication with an event-time TTL)."""
