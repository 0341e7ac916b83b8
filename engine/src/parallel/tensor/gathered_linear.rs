//! The linear map at the entrance of Megatron-SP's tensor-parallel region: the input arrives
//! as this rank's block of the sequence, is all-gathered along the sequence and multiplied by
//! this rank's block of the weight. Composing the differentiable all-gather with `linear`
//! would be exact too, but autograd would then keep the gathered input (the whole sequence)
//! for the weight's gradient, and the sequence-split region would hold a full-size activation
//! after all. As in Megatron, this function saves only the local block and gathers it again
//! in backward, overlapping that gather with the input gradient's matmul and the input
//! gradient's reduce-scatter with the weight gradient's.
use tch::Tensor;

use crate::autograd::collectives::Collective;
use crate::autograd::function::{apply, Forward};
use crate::dist::ProcessGroup;
use crate::error::ensure;
use crate::Result;

/// `all_gather(x, dim) W^T + b` over group `g`, keeping only `x` (this rank's block) for
/// backward. Gradients: `x` gets the reduce-scatter along `dim` of `dy W`, `W` gets
/// `dy^T X` with `X` gathered again, `b` the sum of `dy`.
pub(crate) fn all_gather_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    dim: i64,
    g: &ProcessGroup,
) -> Result<Tensor> {
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    let (group, has_bias) = (g.clone(), bias.is_some());
    let out = apply(
        "sequence-parallel column linear",
        &inputs,
        |i| {
            let gathered = Collective::AllGather { dim }.start(&i[0], g)?.wait()?;
            let y = gathered.f_linear(&i[1], i.get(2))?;
            Ok(Forward {
                outputs: vec![y],
                saved: vec![i[0].shallow_clone(), i[1].shallow_clone()],
                ..Forward::default()
            })
        },
        move |grads, saved| {
            let [x, w] = saved else {
                return Err(crate::Error::invalid(format!("{} saved tensors, expected 2", saved.len())));
            };
            let dy = &grads[0];
            let (out_features, in_features) = (w.size()[0], w.size()[1]);
            let gather = Collective::AllGather { dim }.start(x, &group)?;
            let dx_full = dy.f_matmul(w)?;
            let gathered = gather.wait()?;
            let scatter = Collective::ReduceScatter { dim }.start(&dx_full, &group)?;
            let dy2 = dy.f_reshape([-1, out_features])?;
            ensure!(
                gathered.numel() as i64 == dy2.size()[0] * in_features,
                "the gathered input has {} elements, expected {} rows of {in_features}",
                gathered.numel(),
                dy2.size()[0]
            );
            let dw = dy2.f_tr()?.f_matmul(&gathered.f_reshape([-1, in_features])?)?;
            let mut result = vec![None, Some(dw)];
            if has_bias {
                result.push(Some(dy2.f_sum_dim_intlist(&[0i64][..], false, dy.kind())?));
            }
            result[0] = Some(scatter.wait()?);
            Ok(result)
        },
    )?;
    Ok(out.into_iter().next().expect("one output"))
}
