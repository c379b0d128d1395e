# expect: CPU time limit|killed by SIGKILL|wall time limit
while True:
    pass
