"""Which node each catalogue model runs on (Prism §6.2): Algorithm 1 by KV pressure,
the periodic loop that moves models, and the request rates it weighs them by."""
