-- The interval each node says it beats at (heartbeats since issue 10), in ms.
-- NULL: an agent that does not say, judged by the fleet's floor interval.
ALTER TABLE inventory.nodes ADD COLUMN beat_ms bigint;
