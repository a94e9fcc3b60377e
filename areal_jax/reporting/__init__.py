"""What a training run shows and writes: the reporter, the stats keys it reads, the plots."""
