"""The objective's annotated dtypes and shapes are checked at every call under the test suite (pytest.ini's
--jaxtyping-packages): a tensor of the wrong shape fails at the call that gets it, naming the argument, instead of
broadcasting into a wrong loss further on."""
import pytest
import torch
from jaxtyping import TypeCheckError

from torchrl_grpo.objective.aggregation import aggregate
from torchrl_grpo.objective.surrogates import SurrogateInputs, clipped_surrogate

N, L = 3, 4


@pytest.fixture(autouse=True)
def checker_on(request):
    """Fail unless pytest.ini turns the checker on; skip when the command line turns it off on purpose."""
    if request.config.getoption("jaxtyping_packages") == "":
        pytest.skip("the shape checker is turned off (--jaxtyping-packages=)")


def test_a_mask_one_token_longer_than_the_values_fails_at_the_call():
    with pytest.raises(TypeCheckError, match="parameter 'mask'"):
        aggregate(torch.zeros(N, L), torch.ones(N, L + 1, dtype=torch.bool), "token_mean")


def test_advantages_for_one_row_too_many_fail_at_the_call():
    # [N + 1] against [N, L] log-probs: no broadcast could have hidden it, but [N, 1] would have broadcast silently
    for advantages in (torch.zeros(N + 1), torch.zeros(N, 1)):
        with pytest.raises(TypeCheckError, match="parameter 'advantages'"):
            clipped_surrogate(torch.zeros(N, L), torch.zeros(N, L), advantages, 0.2, 0.2)


def test_the_surrogate_inputs_hold_their_fields_to_one_n_and_l_and_to_their_dtypes():
    fields = dict(logp=torch.zeros(N, L), logp_old=torch.zeros(N, L), logp_sample=torch.zeros(N, L),
                  advantages=torch.zeros(N), mask=torch.ones(N, L, dtype=torch.bool), importance_level="token",
                  eps_low=0.2, eps_high=0.2)
    SurrogateInputs(**fields)
    for name, wrong in (("logp_sample", torch.zeros(N, L + 1)), ("mask", torch.ones(N, L)),
                        ("logp_old", torch.zeros(N, L, dtype=torch.long))):
        with pytest.raises(TypeCheckError, match=name):
            SurrogateInputs(**{**fields, name: wrong})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_float_precision_passes(dtype):
    logp = torch.zeros(N, L, dtype=dtype)
    loss, *_ = clipped_surrogate(logp, logp, torch.ones(N, dtype=dtype), 0.2, 0.2)
    assert aggregate(loss, torch.ones(N, L, dtype=torch.bool), "sequence_mean").item() == -1.0
