"""A small slippery grid game in the style of RAGEN's FrozenLake: walk from the start to the goal, avoid holes.

The observation is the rendered grid, one text row per map row, each ended by a newline (`.` floor,
`#` hole, `g` goal, `p` the player); the policy answers with a move word and the end-of-turn mark
(`left]`). A move slips to either perpendicular side with probability slip / 2 each; the goal ends the
episode with reward 1 (info["success"]), a hole with 0; anything but a move word is an error
observation (`info["tool_errors"]`). info["shaping"] is +0.1 / -0.1 as the shortest-path distance to
the goal shrinks / grows (used only with agent.shaping_weight > 0).

The warm-start teacher, with probability error_rate per episode, walks straight at the goal into any
hole on the way (most records are trap maps, TRAP_SHARE). Default 4x4 maps fit
data.max_prompt_len=24, rollout.max_new_tokens=136, agent.max_turns=6, model.max_seq_len >= 160.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxrl.agents.env import AGENT_ALPHABET, EnvSuite, StepResult
from jaxrl.config import ConfigError

FLOOR, HOLE, GOAL, PLAYER = ".", "#", "g", "p"
END_OF_TURN = "]"
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
PERPENDICULAR = {"up": ("left", "right"), "down": ("left", "right"), "left": ("up", "down"), "right": ("up", "down")}
INVALID = "invalid\n"  # the error observation of an action that is not a move word
SHAPING = 0.1

# The defaults of the embedded suite. Slip 0.1 keeps the moves slippery with less reward noise than 0.2.
# A trap map is one whose careless walk (straight towards the goal) crosses a hole (is_trap): 29% of the
# maps drawn at random are; records draw a trap map with probability TRAP_SHARE, so that the careless
# teacher's systematic error matters on most maps (benchmarks/README.md has each policy's success rate).
SIZE, HOLES, SLIP = 4, 3, 0.1
TRAP_SHARE = 0.75
MIN_DISTANCE, MAX_DISTANCE = 2, 5  # the start's shortest-path distance to the goal
MAX_TURNS = 6  # the teacher's episode length limit (it fits rollout.max_new_tokens=136: docs/agents.md)
TEST_SHARE = 4  # one (map, start) in TEST_SHARE belongs to the test split, by a hash of its text


def parse_map(text: str) -> list[str]:
    rows = text.split("\n")
    if not rows or any(len(r) != len(rows[0]) for r in rows) or set("".join(rows)) - {FLOOR, HOLE, GOAL}:
        raise ValueError(f"gridworld map {text!r}: expected equal rows of {FLOOR!r}, {HOLE!r}, {GOAL!r}")
    if "".join(rows).count(GOAL) != 1:
        raise ValueError(f"gridworld map {text!r}: expected exactly one goal {GOAL!r}")
    return rows


def render(rows: list[str], pos: tuple[int, int]) -> str:
    r, c = pos
    shown = [row if i != r else row[:c] + PLAYER + row[c + 1 :] for i, row in enumerate(rows)]
    return "".join(row + "\n" for row in shown)


def goal_distances(rows: list[str]) -> dict:
    """Shortest-path distance to the goal of every floor cell that can reach it (holes are walls)."""
    (goal,) = [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == GOAL]
    dist, queue = {goal: 0}, collections.deque([goal])
    while queue:
        cell = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if _inside(rows, nxt) and rows[nxt[0]][nxt[1]] != HOLE and nxt not in dist:
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return dist


def best_move(rows: list[str], pos: tuple[int, int]) -> str:
    """The move (first in MOVES order on ties) whose target is closest to the goal."""
    dist = goal_distances(rows)
    far = len(rows) * len(rows[0]) + 1
    return min(MOVES, key=lambda m: dist.get(_moved(rows, pos, m), far))


def careless_move(rows: list[str], pos: tuple[int, int]) -> str:
    """The move straight towards the goal by Manhattan distance, rows first, then columns; holes ignored."""
    (goal,) = [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == GOAL]
    if goal[0] != pos[0]:
        return "down" if goal[0] > pos[0] else "up"
    return "right" if goal[1] > pos[1] else "left"


def is_trap(rows: list[str], start: tuple[int, int]) -> bool:
    """Whether the careless walk from `start` (no slips) steps into a hole before it reaches the goal."""
    pos = start
    while rows[pos[0]][pos[1]] != GOAL:
        pos = _moved(rows, pos, careless_move(rows, pos))
        if rows[pos[0]][pos[1]] == HOLE:
            return True
    return False


def _inside(rows, cell) -> bool:
    return 0 <= cell[0] < len(rows) and 0 <= cell[1] < len(rows[0])


def _moved(rows, pos, move: str) -> tuple[int, int]:
    dr, dc = MOVES[move]
    nxt = (pos[0] + dr, pos[1] + dc)
    return nxt if _inside(rows, nxt) else pos


def parse_action(action: str) -> str | None:
    """`left]` (or `left` when the policy ended with EOS) -> "left"; anything else -> None."""
    word = action.strip()
    word = word[: -len(END_OF_TURN)] if word.endswith(END_OF_TURN) else word
    return word if word in MOVES else None


class GridWorld:
    """One episode of the slippery grid game (see the module docstring)."""

    def __init__(self, slip: float = SLIP):
        if not 0 <= slip <= 1:
            raise ValueError(f"gridworld slip: expected a probability in [0, 1], got {slip}")
        self.slip = slip
        # Set by `reset`; `done` until then.
        self.rows: list[str] | None = None
        self.pos: tuple[int, int] | None = None
        self.rng: np.random.Generator | None = None
        self.done = True

    def reset(self, record: dict, rng: np.random.Generator) -> str:
        rows = parse_map(record["map"])
        start = tuple(int(x) for x in record["start"].split(","))
        if len(start) != 2 or not _inside(rows, start) or rows[start[0]][start[1]] != FLOOR:
            raise ValueError(f"gridworld record {record.get('id')!r}: start {record['start']!r} is not a floor cell")
        self.rows, self.pos = rows, start
        self.rng, self.done = rng, False
        self._dist = goal_distances(self.rows)
        return render(self.rows, self.pos)

    def step(self, action: str) -> StepResult:
        if self.done:  # nothing left to play; never raise for what the policy writes
            return StepResult("", 0.0, True, {"success": False})
        assert self.rows is not None and self.pos is not None and self.rng is not None  # not done: reset ran
        move = parse_action(action)
        if move is None:
            return StepResult(INVALID, 0.0, False, {"tool_errors": 1, "success": False, "shaping": 0.0})
        u = self.rng.random()  # one draw per move: slip to one side, the other side, or go as intended
        if u < self.slip / 2:
            move = PERPENDICULAR[move][0]
        elif u < self.slip:
            move = PERPENDICULAR[move][1]
        before, self.pos = self.pos, _moved(self.rows, self.pos, move)
        cell = self.rows[self.pos[0]][self.pos[1]]
        far = len(self.rows) * len(self.rows[0]) + 1  # a hole is farther than any floor cell
        d_before, d_after = self._dist[before], self._dist.get(self.pos, far)
        shaping = SHAPING * float(np.sign(d_before - d_after))
        self.done = cell in (GOAL, HOLE)
        success = cell == GOAL
        observation = "" if self.done else render(self.rows, self.pos)
        return StepResult(
            observation, float(success), self.done, {"tool_errors": 0, "success": success, "shaping": shaping}
        )


def random_map(
    rng: np.random.Generator, size: int = SIZE, holes: int = HOLES, trap: bool | None = None
) -> tuple[str, tuple[int, int]]:
    """A (map text, start) whose start reaches the goal in MIN_DISTANCE..MAX_DISTANCE moves around the holes;
    with trap=True / False one whose careless walk does / does not cross a hole (is_trap), None: either."""
    while True:
        cells = rng.permutation(size * size)[: holes + 2]  # goal, start, then the holes
        grid = [[FLOOR] * size for _ in range(size)]
        goal, start = divmod(int(cells[0]), size), divmod(int(cells[1]), size)
        grid[goal[0]][goal[1]] = GOAL
        for cell in cells[2:]:
            r, c = divmod(int(cell), size)
            grid[r][c] = HOLE
        rows = ["".join(row) for row in grid]
        solvable = MIN_DISTANCE <= goal_distances(rows).get(start, -1) <= MAX_DISTANCE
        if solvable and trap in (None, is_trap(rows, start)):
            return "\n".join(rows), start


def split_of(map_text: str, start: str) -> str:
    """ "test" for one (map, start) in TEST_SHARE, by a stable hash of its text: the splits never share one."""
    digest = hashlib.sha256(f"{map_text}|{start}".encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


def records(split: str, n: int, seed: int) -> list[dict]:
    """n distinct task records {"id", "map", "start"} of `split`, deterministic in (split, n, seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"gridworld records: split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out, seen, misses = [], set(), 0
    while len(out) < n and misses <= 20_000:  # 20k draws without a new one: the split is (nearly) exhausted
        map_text, (r, c) = random_map(rng, trap=bool(rng.random() < TRAP_SHARE))
        start = f"{r},{c}"
        if split_of(map_text, start) != split or (map_text, start) in seen:
            misses += 1
            continue
        misses = 0
        seen.add((map_text, start))
        out.append({"id": f"gridworld-{split}-{len(out)}", "map": map_text, "start": start})
    if len(out) == n:
        return out
    field = "data.num_train" if split == "train" else "data.num_test"
    raise ConfigError(f"{field}={n}: found only {len(out)} distinct gridworld {split} maps; ask for fewer")


def teacher(record: dict, rng: np.random.Generator, error_rate: float, max_turns: int = MAX_TURNS) -> list:
    """A player that is careless for a whole episode with probability error_rate (it walks straight
    towards the goal, careless_move, into any hole on the way) and otherwise takes the shortest path
    around the holes (best_move), played against a real (slippery) GridWorld until it says done or
    max_turns moves. The error is systematic, not noise: on a trap map the careless walk is the
    demonstrations' majority move (for error_rate > 0.5), so an imitator's greedy move walks into the hole
    and RL has to learn to go around.

    The environment is reset with `rng` itself (so the prompt is `reset(record, rng)` of a generator
    seeded alike) and draws only its slips from it; the teacher's choice comes from a child generator
    (spawning leaves `rng`'s stream alone). So replaying the moves against a GridWorld reset with a
    generator seeded like `rng` reproduces the episode's observations exactly."""
    (choice_rng,) = rng.spawn(1)
    policy = careless_move if choice_rng.random() < error_rate else best_move
    env = GridWorld()
    env.reset(record, rng)
    assert env.rows is not None and env.pos is not None  # set by reset
    segments = []
    for _ in range(max_turns):
        move = policy(env.rows, env.pos)
        result = env.step(move + END_OF_TURN)
        segments.append((move + END_OF_TURN, True))
        if result.observation:
            segments.append((result.observation, False))
        if result.done:
            break
    return segments


SUITE = EnvSuite(
    name="agent_gridworld",
    make=lambda agent_cfg, fmt=None: GridWorld(),
    records=records,
    teacher=teacher,
    alphabet=AGENT_ALPHABET,
    end_of_turn=END_OF_TURN,
)
