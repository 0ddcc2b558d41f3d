"""Test support that ships with the app: a Stripe fake of our own (see stripe_fake)."""
