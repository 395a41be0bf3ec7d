"""Layer freezing in the trainer (Egeria, Wang et al., EuroSys'23).

`controller.Freezer` is the policy around any training loop; `setup.start` builds it for the
default loop. The reference model runs in its own CPU process (`reference`).
"""
