# expect: process limit|killed by
import os
while True:
    os.fork()
