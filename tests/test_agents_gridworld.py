"""The gridworld environment (jaxrl.agents.gridworld): dynamics by hand, slip frequencies, rendering,
records and the teacher's episodes replayed against a fresh environment."""

import threading

import numpy as np
import pytest

from jaxrl.agents.env import AGENT_ALPHABET
from jaxrl.agents.gridworld import (
    INVALID,
    MAX_DISTANCE,
    MAX_TURNS,
    MIN_DISTANCE,
    TRAP_SHARE,
    GridWorld,
    best_move,
    careless_move,
    goal_distances,
    is_trap,
    parse_map,
    records,
    split_of,
    teacher,
)
from jaxrl.config import ConfigError
from jaxrl.data.registry import get_task

# 0123
# ....   row 0
# .#..   row 1
# ....   row 2
# ...g   row 3
OPEN = {"id": "hand", "map": "....\n.#..\n....\n...g", "start": "0,0"}


def _env(record=OPEN, slip=0.0, seed=0):
    env = GridWorld(slip=slip)
    return env, env.reset(record, np.random.default_rng(seed))


def test_reset_renders_the_grid_with_the_player():
    _, obs = _env()
    assert obs == "p...\n.#..\n....\n...g\n"


def test_moves_edges_and_holes_by_hand():
    env, _ = _env()
    up = env.step("up]")  # row 0: the edge, the player stays at (0, 0)
    assert up.observation == "p...\n.#..\n....\n...g\n" and not up.done and up.reward == 0.0
    right = env.step("right]")  # -> (0, 1)
    assert right.observation == ".p..\n.#..\n....\n...g\n" and not right.done
    left_edge = env.step("left]")  # -> (0, 0)
    assert left_edge.observation == "p...\n.#..\n....\n...g\n"
    env.step("right]")
    hole = env.step("down]")  # (0, 1) -> (1, 1): the hole ends the episode, no reward
    assert hole.done and hole.reward == 0.0 and hole.info["success"] is False and hole.observation == ""
    after = env.step("down]")  # over: the env answers, never raises
    assert after.done and after.reward == 0.0 and after.observation == ""


def test_goal_gives_reward_one_and_success():
    env, _ = _env({"id": "g", "map": "....\n.#..\n....\n...g", "start": "3,2"})
    result = env.step("right]")
    assert (result.reward, result.done, result.info["success"], result.observation) == (1.0, True, True, "")


def test_unparseable_action_is_an_error_observation_and_a_wasted_turn():
    env, first = _env()
    for bad in ("jump]", "upp]", "", "up down]", "]"):
        result = env.step(bad)
        assert result.observation == INVALID and not result.done and result.info["tool_errors"] == 1
    assert env.pos == (0, 0)
    ok = env.step(" down")  # an action the policy ended with EOS instead of "]" still moves
    assert ok.info["tool_errors"] == 0 and env.pos == (1, 0)


def test_shaping_follows_the_shortest_path_distance():
    # Distances to the goal (3, 3) around the hole (1, 1): (0, 0) -> 6, (0, 1) -> 5, (1, 0) -> 5.
    dist = goal_distances(parse_map(OPEN["map"]))
    assert (dist[(0, 0)], dist[(0, 1)], dist[(1, 0)], dist[(2, 2)]) == (6, 5, 5, 2)
    env, _ = _env()
    assert env.step("right]").info["shaping"] == pytest.approx(0.1)  # 6 -> 5
    assert env.step("left]").info["shaping"] == pytest.approx(-0.1)  # 5 -> 6
    assert env.step("up]").info["shaping"] == 0.0  # the edge: 6 -> 6
    env.step("right]")
    assert env.step("down]").info["shaping"] == pytest.approx(-0.1)  # into the hole: growing


def test_slip_goes_perpendicular_with_the_configured_frequency():
    # From the centre of an open 3x3 map, "up" with slip 0.3 goes up 70%, left 15%, right 15%, never down.
    record = {"id": "s", "map": "...\n...\n..g", "start": "1,1"}
    rng = np.random.default_rng(123)
    ends = {"up": 0, "left": 0, "right": 0, "down": 0}
    where = {(0, 1): "up", (1, 0): "left", (1, 2): "right", (2, 1): "down"}
    n = 4000
    for _ in range(n):
        env = GridWorld(slip=0.3)
        env.reset(record, rng)
        env.step("up]")
        ends[where[env.pos]] += 1
    # Binomial std of a 15% share over 4000 draws: sqrt(.15 * .85 / 4000) = 0.0056; 4 std = 0.023.
    assert ends["down"] == 0
    assert abs(ends["up"] / n - 0.7) < 0.03
    assert abs(ends["left"] / n - 0.15) < 0.023 and abs(ends["right"] / n - 0.15) < 0.023


def test_slip_zero_is_deterministic_and_bad_slip_is_refused():
    env, _ = _env(slip=0.0)
    for _ in range(3):
        env.step("down]")
    assert env.pos == (3, 0)
    with pytest.raises(ValueError, match="slip"):
        GridWorld(slip=1.5)


def test_records_are_deterministic_disjoint_solvable_and_render_in_the_alphabet():
    train, test = records("train", 400, 7), records("test", 100, 7)
    assert train == records("train", 400, 7) and train != records("train", 400, 8)
    assert records("train", 50, 7) == train[:50]  # a prefix: n does not reshuffle

    def keys(rs):
        return {(r["map"], r["start"]) for r in rs}

    assert len(keys(train)) == 400 and len(keys(test)) == 100 and not keys(train) & keys(test)
    assert all(split_of(r["map"], r["start"]) == "train" for r in train)
    for r in train + test:
        rows = parse_map(r["map"])
        start = tuple(int(x) for x in r["start"].split(","))
        assert MIN_DISTANCE <= goal_distances(rows)[start] <= MAX_DISTANCE
        obs = GridWorld().reset(r, np.random.default_rng(0))
        assert set(obs) <= set(AGENT_ALPHABET) and len(obs) + 1 <= 24  # BOS + the prompt fit 24 tokens
    with pytest.raises(ValueError, match="split"):
        records("valid", 3, 0)


def test_teacher_episodes_replay_against_a_fresh_environment():
    suite = get_task("agent_gridworld").suite
    assert suite.teacher is teacher and suite.end_of_turn == "]"
    for i, record in enumerate(records("test", 30, 1)):
        for error in (0.0, 0.5):
            segments = teacher(record, np.random.default_rng(i), error)
            assert segments[0][1] and all(set(text) <= set(AGENT_ALPHABET) for text, _ in segments)
            env = GridWorld()
            env.reset(record, np.random.default_rng(i))
            moves = [text for text, by_model in segments if by_model]
            assert all(m.endswith("]") for m in moves) and 1 <= len(moves) <= MAX_TURNS
            replayed = []
            for move in moves:
                result = env.step(move)
                replayed += [(move, True)] + ([(result.observation, False)] if result.observation else [])
            assert replayed == segments
            assert env.done or len(moves) == MAX_TURNS  # ends on done or at the turn limit


def test_teacher_without_errors_or_slips_walks_a_shortest_path():
    record = {"id": "t", "map": "....\n.#..\n....\n...g", "start": "0,0"}
    # Without slips the shortest-path moves reach the goal in its BFS distance: 6 moves.
    env = GridWorld(slip=0.0)
    env.reset(record, np.random.default_rng(0))
    moves = []
    while not env.done:
        moves.append(best_move(env.rows, env.pos))
        env.step(moves[-1] + "]")
    assert len(moves) == 6 and env.pos == (3, 3)
    segments = teacher(record, np.random.default_rng(0), 0.0)
    env = GridWorld()
    env.reset(record, np.random.default_rng(0))
    for text, by_model in segments:
        if by_model:  # with error 0 every move is the shortest-path move from where the player stands
            assert text == best_move(env.rows, env.pos) + "]"
            env.step(text)


# 0123
# ..g.   row 0    start (3, 2): the careless walk goes up (rows first) through the hole at (2, 2);
# ....   row 1    the shortest path around it goes left first: (3, 1) (2, 1) (1, 1) (0, 1) (0, 2),
# ..#.   row 2    or right: (3, 3) (2, 3) (1, 3) (0, 3) (0, 2); both are 5 moves, and best_move's tie-break
# ....   row 3    (MOVES order: up, down, left, right) takes "left".
TRAP = {"id": "trap", "map": "..g.\n....\n..#.\n....", "start": "3,2"}


def test_careless_move_walks_rows_first_then_columns_into_holes():
    rows = parse_map(TRAP["map"])
    assert careless_move(rows, (3, 2)) == "up"  # straight up into the hole at (2, 2)
    assert careless_move(rows, (3, 0)) == "up" and careless_move(rows, (1, 3)) == "up"  # rows first
    assert careless_move(rows, (0, 0)) == "right" and careless_move(rows, (0, 3)) == "left"  # then columns
    assert best_move(rows, (3, 2)) == "left"
    assert is_trap(rows, (3, 2))  # up from (3, 2) is the hole (2, 2)
    assert not is_trap(rows, (3, 0))  # up (2, 0) (1, 0) (0, 0), right (0, 1) (0, 2): no hole on the way
    assert not is_trap(rows, (1, 2))  # one step up: the goal
    env, _ = _env(TRAP)
    assert env.step(careless_move(env.rows, env.pos) + "]").done and env.pos == (2, 2)  # the hole, reward 0


def test_teacher_is_careless_per_episode_with_the_error_rate():
    # On TRAP the first move says which player the episode got: "up" careless, "left" shortest path.
    # Every later move of an episode is the same player's move from where the player stands (slips
    # included), so the error is drawn once per episode, not per turn.
    n, careless = 1000, 0
    for i in range(n):
        segments = teacher(TRAP, np.random.default_rng(i), 0.6)
        env = GridWorld()
        env.reset(TRAP, np.random.default_rng(i))
        moves = [text for text, by_model in segments if by_model]
        policy = careless_move if moves[0] == "up]" else best_move
        careless += policy is careless_move
        for move in moves:
            assert move == policy(env.rows, env.pos) + "]", (i, moves)
            env.step(move)
    # Binomial std of a 60% share over 1000 episodes: sqrt(.6 * .4 / 1000) = 0.0155; 4 std = 0.062.
    assert abs(careless / n - 0.6) < 0.062, careless
    assert all(teacher(TRAP, np.random.default_rng(i), 1.0)[0][0] == "up]" for i in range(20))
    assert all(teacher(TRAP, np.random.default_rng(i), 0.0)[0][0] == "left]" for i in range(20))


def test_records_draw_trap_maps_with_the_trap_share():
    train = records("train", 1000, 3)
    share = np.mean([is_trap(parse_map(r["map"]), tuple(int(x) for x in r["start"].split(","))) for r in train])
    # Binomial std over 1000 records at 0.75: sqrt(.75 * .25 / 1000) = 0.0137; 4 std = 0.055. A map drawn
    # at random is a trap about 29% of the time, far outside this band.
    assert abs(share - TRAP_SHARE) < 0.055, share


@pytest.mark.slow
def test_asking_for_more_maps_than_exist_names_the_field(monkeypatch):
    import jaxrl.agents.gridworld as gw

    monkeypatch.setattr(gw, "split_of", lambda map_text, start: "train")  # no test map exists at all
    raised = []

    def ask():
        try:
            gw.records("test", 1, 0)
        except ConfigError as e:
            raised.append(str(e))

    worker = threading.Thread(target=ask, daemon=True)  # a hang fails the test instead of stalling the suite
    worker.start()
    worker.join(60)  # about 1 s when the search gives up after 20k draws without a new map
    assert not worker.is_alive() and raised and "data.num_test=1" in raised[0], raised


def test_start_must_be_one_floor_cell():
    for start in ("1,1", "0,0,0", "7"):  # a wall, three coordinates, one coordinate
        with pytest.raises(ValueError, match=f"start '{start}' is not a floor cell"):
            GridWorld().reset({**OPEN, "start": start}, np.random.default_rng(0))
    env = GridWorld()
    assert env.done and env.step("up]").done  # before any reset: nothing to play, no crash
