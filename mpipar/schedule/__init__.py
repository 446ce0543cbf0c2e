"""Schedules as data: one master schedule, given a placement w(s, b, d) and an order n(s, b, d) (seed 001).

    strategies.py   jobs (s, b, d), the built-in strategies, registering your own or loading a table
    simulate.py     the clock-free greedy simulator: latency, transfers, activation storage per worker
    diagram.py      the pipeline diagram of a simulated timeline (text, or PNG)

Exercised by: mpipar schedule show --scheme lpp --workers 4 --stages 8 --micro-batches 8 --loops 2
"""
