"""Reading what users hand to a command (reading), writing output files atomically (writing), and pushing a finished
model directory to the Hub (hub)."""
