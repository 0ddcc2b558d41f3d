"""Usage events: built per request (events), made durable (spool), delivered (sink) by the
producer's two threads (producer)."""
