"""One rank of a local world (app.world.ranks): ``python -m app.world RANK SOCKET WORLD_SIZE BACKEND FOLDER MAIN``,
as ``World`` starts it; not a command for people."""

import sys

from app.world.ranks import serve

rank, path, world_size, backend, folder, main = sys.argv[1:7]
serve(int(rank), path, int(world_size), backend, folder, main)
