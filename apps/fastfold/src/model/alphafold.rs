//! The whole AlphaFold 2 monomer network (supplementary Algorithm 2): the input and recycling
//! embedders, the extra-MSA and Evoformer stacks (under DAP when the [`Exec`]'s group has
//! ranks), the single projection, the structure module and the heads, iterated over the
//! recycling slices of a processed batch.
//!
//! Templates: with parameters that have a template embedding (`model_1`, `model_2`) and a
//! batch with template features, the templates update the pair and add MSA rows
//! ([`crate::model::templates`]); a batch without them runs as AlphaFold does for a query with
//! no template hits (the template embedding then adds exactly zero and its rows are masked).
//!
//! Training dropout ([`AlphaFold::predict`] given a key, with an [`Exec`] that has dropout rates)
//! draws its masks from keys derived from one key per example (see [`pass_keys`]). DeepMind's
//! monomer hands its modules keys from haiku's rng sequence inside its recycling loop; this
//! derivation follows the Multimer's v2.3 splits instead (the loop's, and the extra-MSA stack's
//! chain continued by the Evoformer's, as `EmbeddingsAndEvoformer` continues it), so its masks
//! are AlphaFold's per block for a given block key but not those of a haiku run of the whole
//! monomer from the same seed.
use tch::{Device, Kind, Tensor};

use crate::jax_random::Key;

use crate::features::{Features, TemplateFeatures};
use crate::memory::AttentionLogits;
use crate::model::config::{EvoformerConfig, PresetSizes};
use crate::model::embedders::{pseudo_beta, Embedders, ExtraMsaEmbedder, Recycled};
use crate::model::evoformer::{EvoformerStack, StackInput, StackMsa};
use crate::model::exec::{ChunkOp, Exec};
use crate::model::heads::{HeadInputs, HeadOutputs, Heads};
use crate::model::layers::Stream;
use crate::model::masked_rows::{self, select_rows, MsaRows};
use crate::model::pair_rows::{rank_rows, zero_padded, PairRows};
use crate::model::params::Params;
use crate::model::recycling::{self, Recycling};
use crate::model::structure::{StructureModule, StructureOutput};
use crate::model::templates::Templates;
use crate::model::{ensure, Result};

/// One recycling slice of the processed batch, without the leading dimension, with float
/// features in the model's kind.
pub struct Batch {
    /// `[N]` residue types.
    pub aatype: Tensor,
    /// `[N]`.
    pub residue_index: Tensor,
    /// `[N]`.
    pub seq_mask: Tensor,
    /// [N, 22].
    pub target_feat: Tensor,
    /// [S, N, 49].
    pub msa_feat: Tensor,
    /// [S, N].
    pub msa_mask: Tensor,
    /// [E, N] classes.
    pub extra_msa: Tensor,
    /// [E, N].
    pub extra_has_deletion: Tensor,
    /// [E, N].
    pub extra_deletion_value: Tensor,
    /// [E, N].
    pub extra_msa_mask: Tensor,
    /// Template features [T, ...], when the batch has them.
    pub templates: Option<TemplateFeatures>,
}

impl Batch {
    /// A batch of `n` residues, `s` MSA and `e` extra rows of random features, every row real,
    /// on the CPU in `kind` (seeded: the same every call): the inputs of the measurements of a
    /// pass's memory (`tests/memory.rs`, `benches/dap_memory.rs`), whose peaks depend on the
    /// sizes alone.
    pub fn random(n: i64, s: i64, e: i64, kind: Kind) -> Batch {
        tch::manual_seed(3);
        let f = (kind, Device::Cpu);
        let aatype = Tensor::randint(20, [n], (Kind::Int64, Device::Cpu));
        Batch {
            target_feat: aatype.one_hot(22).to_kind(kind),
            aatype,
            residue_index: Tensor::arange(n, (Kind::Int64, Device::Cpu)),
            seq_mask: Tensor::ones([n], f),
            msa_feat: Tensor::rand([s, n, 49], f),
            msa_mask: Tensor::ones([s, n], f),
            extra_msa: Tensor::randint(23, [e, n], (Kind::Int64, Device::Cpu)),
            extra_has_deletion: Tensor::zeros([e, n], f),
            extra_deletion_value: Tensor::rand([e, n], f),
            extra_msa_mask: Tensor::ones([e, n], f),
            templates: None,
        }
    }

    /// Slice `iteration` of `features`, float features converted to `kind`.
    pub fn new(features: &Features, iteration: i64, kind: Kind) -> Result<Batch> {
        let f = features.iteration(iteration).map_err(|e| crate::model::Error::Invalid(format!("features: {e}")))?;
        let long = |t: &Tensor| -> Result<Tensor> { Ok(t.f_squeeze_dim(0)?) };
        let float = |t: &Tensor| -> Result<Tensor> { Ok(t.f_squeeze_dim(0)?.f_to_kind(kind)?) };
        Ok(Batch {
            aatype: long(&f.aatype)?,
            residue_index: long(&f.residue_index)?,
            seq_mask: float(&f.seq_mask)?,
            target_feat: float(&f.target_feat)?,
            msa_feat: float(&f.msa_feat)?,
            msa_mask: float(&f.msa_mask)?,
            extra_msa: long(&f.extra_msa)?,
            extra_has_deletion: float(&f.extra_has_deletion)?,
            extra_deletion_value: float(&f.extra_deletion_value)?,
            extra_msa_mask: float(&f.extra_msa_mask)?,
            templates: f.templates.as_ref().map(|t| t.map(|x| x.squeeze_dim(0))),
        })
    }

    /// Residues N.
    pub fn residues(&self) -> i64 {
        self.aatype.size()[0]
    }

    /// Every tensor of the batch, the templates' included.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut all = self.resident_tensors();
        all.extend(self.row_features());
        all
    }

    /// The MSA's and extra MSA's per-row features, which a GPU's `predict` keeps on the host
    /// ([`Batch::to_device_rows_on_host`]): `msa_feat`, the extra MSA's four.
    pub fn row_features(&self) -> [&Tensor; 5] {
        [&self.msa_feat, &self.extra_msa, &self.extra_has_deletion, &self.extra_deletion_value, &self.extra_msa_mask]
    }

    /// The tensors [`Batch::to_device_rows_on_host`] puts on the device: all but
    /// [`Batch::row_features`].
    pub fn resident_tensors(&self) -> Vec<&Tensor> {
        let mut all = vec![&self.aatype, &self.residue_index, &self.seq_mask, &self.target_feat, &self.msa_mask];
        if let Some(t) = &self.templates {
            all.extend(t.named().map(|(_, x)| x));
        }
        all
    }

    /// The batch on `device` but for the MSA's and extra MSA's per-row features
    /// ([`Batch::row_features`]), which stay where they are: a pass moves each where it is used
    /// and drops it after (the extra MSA's a chunk of rows at a time), so that at 1,200
    /// residues a GPU does not hold their 0.2 GiB through the stacks.
    pub fn to_device_rows_on_host(self, device: Device) -> Result<Batch> {
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?) };
        Ok(Batch {
            aatype: to(self.aatype)?,
            residue_index: to(self.residue_index)?,
            seq_mask: to(self.seq_mask)?,
            target_feat: to(self.target_feat)?,
            msa_mask: to(self.msa_mask)?,
            templates: match self.templates {
                Some(t) => {
                    let [a, b, c, d, e, g] = t.named().map(|(_, x)| x.f_to_device(device));
                    Some(TemplateFeatures::from_array([a?, b?, c?, d?, e?, g?]))
                }
                None => None,
            },
            ..self
        })
    }

    /// The batch on `device` (itself where it is there already).
    pub fn to_device(self, device: Device) -> Result<Batch> {
        let b = self.to_device_rows_on_host(device)?;
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?) };
        Ok(Batch {
            msa_feat: to(b.msa_feat)?,
            extra_msa: to(b.extra_msa)?,
            extra_has_deletion: to(b.extra_has_deletion)?,
            extra_deletion_value: to(b.extra_deletion_value)?,
            extra_msa_mask: to(b.extra_msa_mask)?,
            ..b
        })
    }

    /// The extra-MSA inputs with at least one row: with `drop_masked`, the rows with an
    /// unmasked entry only ([`masked_rows::unmasked_rows`]: the others change nothing the
    /// stack outputs). An alignment with no (unmasked) extra rows gets one masked row of gaps,
    /// which changes nothing either, as AlphaFold's fixed-size padding does.
    fn extra_rows(&self, drop_masked: bool) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let t = [&self.extra_msa, &self.extra_has_deletion, &self.extra_deletion_value, &self.extra_msa_mask];
        let rows = match drop_masked {
            true => masked_rows::unmasked_rows(&self.extra_msa_mask)?,
            false => None,
        };
        let [a, b, c, d] = match &rows {
            Some(rows) => [
                t[0].f_index_select(0, rows)?,
                t[1].f_index_select(0, rows)?,
                t[2].f_index_select(0, rows)?,
                t[3].f_index_select(0, rows)?,
            ],
            None => t.map(|t| t.shallow_clone()),
        };
        if a.size()[0] > 0 {
            return Ok((a, b, c, d));
        }
        let n = self.residues();
        let float = (self.extra_msa_mask.kind(), self.extra_msa_mask.device());
        const GAP: i64 = 21;
        Ok((
            Tensor::f_full([1, n], GAP, (Kind::Int64, self.aatype.device()))?,
            Tensor::f_zeros([1, n], float)?,
            Tensor::f_zeros([1, n], float)?,
            Tensor::f_zeros([1, n], float)?,
        ))
    }
}

/// Everything one pass produces.
pub struct Pass {
    /// Every head's logits (under DAP inference the pair logits' rows this rank holds:
    /// [`Pass::whole_on_host`], [`Pass::with_whole_heads`]).
    pub heads: HeadOutputs,
    /// The structure module's outputs (final atom positions in `atom37`).
    pub structure: StructureOutput,
    /// The single representation [N, c_s].
    pub single: Tensor,
    /// What the next pass recycles: the MSA's first row, the pair (under DAP inference this
    /// rank's rows: [`Pass::whole_on_host`]), the pseudo-beta positions.
    pub recycled: Recycled,
    /// Which of the pair's rows `recycled` holds.
    pub pair_rows: PairRows,
}

impl Pass {
    /// The pair and the heads' logits with every row on the host of rank 0, as
    /// `--save-outputs` writes them: `Some` there, `None` on the other ranks under DAP
    /// inference (a collective: every rank calls it before rank 0 writes). The rows cross a
    /// rank's block at a time, so no device holds them whole beyond what the pass held.
    pub fn whole_on_host(&self) -> Result<Option<WholeOutputs>> {
        let pair = self.pair_rows.gather_to_host(&self.pair_rows.real_of(&self.recycled.pair)?)?;
        let heads = self.heads.whole_on_host()?;
        Ok(pair.zip(heads).map(|(pair, heads)| WholeOutputs { pair, heads }))
    }

    /// This pass with the heads' logits of every pair row, as the losses read them (a
    /// collective under DAP inference: every rank calls it; validation does).
    pub fn with_whole_heads(self) -> Result<Pass> {
        Ok(Pass { heads: self.heads.whole()?, ..self })
    }
}

/// A pass's outputs that DAP inference holds in rows, made whole on the host
/// ([`Pass::whole_on_host`]).
pub struct WholeOutputs {
    /// The pair [N, N, c_z].
    pub pair: Tensor,
    /// Every head's logits, the pair logits' every row.
    pub heads: HeadOutputs,
}

/// `stack` over a pass's `msa` and `pair`, the pair as `rows` holds it (whole, or this rank's
/// block, returned so), the MSA whole or (under DAP inference) as this rank's rows of it;
/// `masks` the MSA's and the pair's. The MSA comes back as the stack left it, for the caller to
/// read as it needs ([`Heads::read_msa`]: the extra MSA is not read). With `key` (training,
/// where both are whole), the stack's key chain's end is returned.
pub(crate) fn run_stack(
    stack: &EvoformerStack,
    (msa, pair): (StackInput, Tensor),
    (msa_mask, pair_mask): (&Tensor, &Tensor),
    exec: &Exec,
    rows: &PairRows,
    key: Option<Key>,
) -> Result<(StackMsa, Tensor, Option<Key>)> {
    let pair = Stream::new(pair, true);
    if !rows.is_split() {
        let StackInput::Whole(msa) = msa else {
            return Err(crate::model::Error::Invalid("a stack on the whole pair takes the whole MSA".into()));
        };
        let (msa, pair, key) = stack.forward(msa, pair, msa_mask, pair_mask, exec, key)?;
        return Ok((StackMsa::from_whole(msa), pair, key));
    }
    ensure!(key.is_none(), "a stack on the pair's rows runs without dropout");
    let (msa, pair) = stack.forward_pair_rows(msa, pair, msa_mask, pair_mask, exec)?;
    Ok((msa, pair, None))
}

/// The extra-MSA stack's input from the extra MSA's `features` (classes [E, N], has-deletion
/// and deletion value [E, N]) in `kind`: embedded whole, or under DAP inference (`rows` split)
/// only this rank's rows of it, padded as the stack splits them. Whole on every rank, AlphaFold's
/// 5,120 extra rows of 64 channels are larger than the pair below 5,120 residues.
pub(crate) fn extra_msa_input(
    embedder: &ExtraMsaEmbedder,
    (classes, has_deletion, deletion_value): (&Tensor, &Tensor, &Tensor),
    kind: Kind,
    exec: &Exec,
    rows: &PairRows,
) -> Result<StackInput> {
    let embed = |classes: &Tensor, has: &Tensor, value: &Tensor| -> Result<Tensor> {
        Ok(embedder.forward(classes, has, value, exec)?.f_to_kind(kind)?)
    };
    if !rows.is_split() {
        return Ok(StackInput::Whole(Stream::new(embed(classes, has_deletion, deletion_value)?, true)));
    }
    let dap = exec.dap();
    let (start, real, block) = rank_rows(dap, classes.size()[0]);
    let pick = |t: &Tensor| t.f_narrow(0, start, real);
    let local = embed(&pick(classes)?, &pick(has_deletion)?, &pick(deletion_value)?)?;
    let padded = zero_padded(&local, block, dap.padded_len(rows.residues()))?;
    Ok(StackInput::Rows(Stream::new(padded, true)))
}

/// The Evoformer's MSA input: the rows `msa_rows` keeps, the MSA's own made from their
/// features `msa_feat` [S, N, f] by `embed` (row 0 with the recycled row `recycled_row`
/// [`crate::model::embedders::RecyclingEmbedder::first_row`] added by `recycling`) and the
/// rest taken from `template_rows` [T, N, c_m] (rows `S..S + T`). Whole, or under DAP
/// inference (`rows` split) only this rank's block of them, padded as the stack splits them:
/// no rank embeds the MSA whole, and rows left out are never made.
pub(crate) fn evoformer_msa_input(
    embed: impl Fn(&Tensor) -> Result<Tensor>,
    recycling: &crate::model::embedders::RecyclingEmbedder,
    (msa_feat, recycled_row, template_rows): (&Tensor, Tensor, Option<&Tensor>),
    msa_rows: &MsaRows,
    exec: &Exec,
    rows: &PairRows,
) -> Result<StackInput> {
    let kept = msa_rows.kept();
    let (start, real, block) = match rows.is_split() {
        true => rank_rows(exec.dap(), kept.len() as i64),
        false => (0, kept.len() as i64, kept.len() as i64),
    };
    let mine = &kept[start as usize..(start + real) as usize];
    let own = msa_feat.size()[0];
    let (from_msa, from_templates) = mine.split_at(mine.partition_point(|&i| i < own));
    let (size, options) = (recycled_row.size(), (recycled_row.kind(), recycled_row.device()));
    let msa = match from_msa.first() {
        Some(&first) => {
            let mut msa = Stream::new(embed(&select_rows(msa_feat, from_msa)?)?, true);
            if first == 0 {
                recycling.add_first_row(&mut msa, &recycled_row)?;
            }
            Some(msa.into_inner())
        }
        None => None,
    };
    drop(recycled_row);
    let templates = if from_templates.is_empty() {
        None
    } else {
        let t = template_rows.ok_or_else(|| crate::model::Error::Invalid("MSA rows past the MSA's own".into()))?;
        let index: Vec<i64> = from_templates.iter().map(|i| i - own).collect();
        Some(select_rows(t, &index)?)
    };
    let local = match (msa, templates) {
        (Some(msa), Some(templates)) => Tensor::f_cat(&[msa, templates], 0)?,
        (Some(rows), None) | (None, Some(rows)) => rows,
        (None, None) => Tensor::f_zeros([0, size[1], size[2]], options)?,
    };
    Ok(match rows.is_split() {
        false => StackInput::Whole(Stream::new(local, true)),
        true => {
            StackInput::Rows(Stream::new(zero_padded(&local, block, exec.dap().padded_len(rows.residues()))?, true))
        }
    })
}

/// The network over one parameter store.
pub struct AlphaFold {
    embedders: Embedders,
    templates: Option<Templates>,
    extra: Option<EvoformerStack>,
    evoformer: EvoformerStack,
    structure: StructureModule,
    heads: Heads,
    config: EvoformerConfig,
    drop_masked_rows: bool,
    /// Where the parameters are, and each pass's batch goes.
    device: Device,
    /// How its attentions hold their logits without autograd (for the memory plan).
    logits: AttentionLogits,
}

impl AlphaFold {
    /// Every module over `params` (from [`Params::random_model`] or [`Params::load_model`]),
    /// with AlphaFold's preset sizes (the same for every released monomer model).
    pub fn new(params: &Params) -> Result<Self> {
        Self::with_preset(params, &PresetSizes::default())
    }

    /// Every module over `params`, with `preset`'s sizes where the arrays cannot show them
    /// (the structure module's iterations).
    pub fn with_preset(params: &Params, preset: &PresetSizes) -> Result<Self> {
        let config = *params.config();
        Ok(AlphaFold {
            embedders: Embedders::new(params)?,
            templates: Templates::new(params)?,
            extra: match config.num_extra_blocks > 0 {
                true => Some(EvoformerStack::extra(params)?),
                false => None,
            },
            evoformer: EvoformerStack::main(params)?,
            structure: StructureModule::with_preset(params, preset)?,
            heads: Heads::new(params)?,
            config,
            drop_masked_rows: true,
            device: params.iter().next().map_or(Device::Cpu, |(_, t)| t.device()),
            logits: AttentionLogits::of(params.kernels()),
        })
    }

    /// Whether the stacks leave out fully-masked MSA and extra-MSA rows ([`masked_rows`]; on
    /// by default): the outputs are the same either way, the time falls with the real depth.
    /// Off runs every padding row, for comparison.
    pub fn drop_masked_rows(mut self, drop: bool) -> Self {
        self.drop_masked_rows = drop;
        self
    }

    /// The stacks' sizes.
    pub fn config(&self) -> &EvoformerConfig {
        &self.config
    }

    /// How its attentions hold their logits without autograd.
    pub fn attention_logits(&self) -> AttentionLogits {
        self.logits
    }

    /// Slice `iteration` of `features` ([`Batch::new`]) on the network's device: features kept
    /// on the host (a GPU's `predict` keeps them there) reach the device a pass's slice at a
    /// time, and the slice's per-row features only as the pass uses them
    /// ([`Batch::to_device_rows_on_host`]).
    pub fn batch(&self, features: &Features, iteration: i64, kind: Kind) -> Result<Batch> {
        Batch::new(features, iteration, kind)?.to_device_rows_on_host(self.device)
    }

    /// One pass (Algorithm 2, lines 5–33) on `batch` given up the previous pass's outputs:
    /// they are dropped once embedded (the recycled pair is not held beside the new one
    /// through the stacks); a caller that keeps them passes [`Recycled::shallow_clone`].
    /// In training, with `key` (the pass's) and `exec`'s dropout rates, the stacks drop as
    /// [`pass_keys`] derives their keys.
    pub fn pass(&self, batch: &Batch, prev: Recycled, exec: &Exec, key: Option<Key>) -> Result<Pass> {
        let keys = key.filter(|_| exec.dropout().is_some()).map(pass_keys);
        let input = &self.embedders.input;
        // The pass's own pair, whole or under DAP inference this rank's block of its rows: the
        // recycling embedder, the templates and the stacks update it in place when nothing
        // records gradients (split, the embedders update the block's real part, `real`). Its
        // MSA is embedded after the extra-MSA stack, which does not read it: a long query's MSA
        // would take memory through that stack's largest step. Only the recycled row it needs
        // is made now.
        let rows = PairRows::for_pass(exec, batch.residues());
        let prev = Recycled { pair: rows.recycled(exec.dap(), prev.pair)?, ..prev };
        let (block, real) =
            rows.into_block(input.embed_pair(&batch.target_feat, &batch.residue_index, exec, &rows)?)?;
        let mut pair = Stream::new(real, true);
        let recycled_row = self.embedders.recycling.first_row(&prev)?;
        self.embedders.recycling.update_pair(&mut pair, &prev, exec, &rows)?;
        drop(prev);
        let pair_mask = batch.seq_mask.f_unsqueeze(1)?.f_mul(&batch.seq_mask.f_unsqueeze(0)?)?;
        if let (Some(t), Some(f)) = (&self.templates, &batch.templates) {
            let real = match self.drop_masked_rows {
                true => masked_rows::unmasked_rows(&f.mask)?,
                false => None,
            };
            let template_key = keys.map(|k| k.templates);
            match real {
                None => t.add_pair_update(&mut pair, f, &pair_mask, exec, template_key, &rows)?,
                Some(real) if real.size()[0] > 0 => {
                    let [a, b, c, d, e, g] = f.named().map(|(_, x)| x.f_index_select(0, &real));
                    let f = TemplateFeatures::from_array([a?, b?, c?, d?, e?, g?]);
                    t.add_pair_update(&mut pair, &f, &pair_mask, exec, template_key, &rows)?;
                }
                Some(_) => {} // no real template: the update is exactly 0
            }
        }
        let pair = rows.embedded(block, pair.into_inner());
        let mut evoformer_key = keys.map(|k| k.stacks);
        let pair = match (&self.extra, &self.embedders.extra_msa) {
            (Some(stack), Some(embedder)) => {
                let (extra_rows, has_deletion, deletion_value, mask) = batch.extra_rows(self.drop_masked_rows)?;
                let features = (&extra_rows, &has_deletion, &deletion_value);
                let extra = extra_msa_input(embedder, features, pair.kind(), exec, &rows)?;
                drop((extra_rows, has_deletion, deletion_value));
                let mask = mask.f_to_device(self.device)?;
                let key = keys.map(|k| k.stacks);
                let (_, pair, chain) = run_stack(stack, (extra, pair), (&mask, &pair_mask), exec, &rows, key)?;
                // The Evoformer continues the extra-MSA stack's key chain.
                evoformer_key = chain;
                pair
            }
            _ => pair,
        };
        // The MSA, embedded after the extra-MSA stack (which does not read it), then its rows
        // joined by the templates'; only the rows that run are made, under DAP only the rank's.
        let own_rows = batch.msa_feat.size()[0];
        let template_rows = match (&self.templates, &batch.templates) {
            (Some(t), Some(f)) => t.msa_rows(f, pair.kind())?,
            _ => None,
        };
        let (template_rows, template_mask) = template_rows.unzip();
        let msa_mask = match template_mask {
            Some(mask) => Tensor::f_cat(&[&batch.msa_mask, &mask], 0)?,
            None => batch.msa_mask.shallow_clone(),
        };
        let msa_rows = MsaRows::choose(self.drop_masked_rows, &batch.msa_feat, &msa_mask, own_rows)?;
        let msa_mask = msa_rows.select(&msa_mask)?;
        let embed = |features: &Tensor| input.embed_msa(&batch.target_feat, &features.f_to_device(self.device)?);
        let features = (&batch.msa_feat, recycled_row, template_rows.as_ref());
        let msa = evoformer_msa_input(embed, &self.embedders.recycling, features, &msa_rows, exec, &rows)?;
        drop(template_rows);
        let masks = (&msa_mask, &pair_mask);
        let (msa, pair, _) = run_stack(&self.evoformer, (msa, pair), masks, exec, &rows, evoformer_key)?;
        // What the pass reads of the MSA's own rows (the template rows end here), on the device
        // (an offloading Evoformer leaves the MSA on the host), before the structure module:
        // the MSA is gone before the pass's last steps.
        let readout = self.heads.read_msa(msa, &msa_rows, self.device)?;
        let ipa_chunk = exec.chunk_for(ChunkOp::StructureAttention);
        let dropout = keys.zip(exec.dropout()).map(|(k, d)| (k.structure, d.structure_module));
        let real = rows.real_of(&pair)?;
        let structure = self.structure.run_rows(
            &readout.single,
            &real,
            &rows,
            &batch.aatype,
            &batch.seq_mask,
            ipa_chunk,
            dropout,
        )?;
        let inputs = HeadInputs { msa: &readout, pair: &real, pair_rows: &rows, structure_single: &structure.single };
        let heads = self.heads.forward(&inputs)?;
        drop(real);
        let pseudo_beta = pseudo_beta(&batch.aatype, &structure.atom37)?.f_to_kind(pair.kind())?;
        let (single, msa_first_row) = (readout.single, readout.first_row);
        Ok(Pass { heads, structure, single, recycled: Recycled { msa_first_row, pair, pseudo_beta }, pair_rows: rows })
    }

    /// `recycles + 1` passes over slices `0..=recycles` of `features` in `kind`, each starting
    /// from the previous one's outputs; the last pass is returned. As in AlphaFold, gradients
    /// flow through the last pass only: the earlier ones run without autograd.
    ///
    /// In training: with `key` (the example's) and `exec`'s dropout rates, every pass drops
    /// (recycles too, as AlphaFold's training passes all run in training mode), recycle `i`
    /// under the second key of the loop key's split and the last pass under the loop key as it
    /// stands (the Multimer's v2.3 loop).
    pub fn predict(
        &self,
        features: &Features,
        recycles: usize,
        kind: Kind,
        exec: &Exec,
        key: Option<Key>,
    ) -> Result<Pass> {
        let available = features.num_iterations();
        ensure!(
            (recycles as i64) < available,
            "{recycles} recycles need {} feature slices, the features have {available}",
            recycles + 1
        );
        let mut prev = self.first_recycled(features, kind, exec)?;
        let mut key = key;
        for i in 0..recycles as i64 {
            let batch = self.batch(features, i, kind)?;
            let split = key.map(|k| k.split(2));
            key = split.as_ref().map(|k| k[0]);
            let pass_key = split.as_ref().map(|k| k[1]);
            prev = tch::no_grad(|| self.pass(&batch, prev, exec, pass_key))?.recycled;
        }
        self.pass(&self.batch(features, recycles as i64, kind)?, prev, exec, key)
    }

    /// What the first pass recycles: zeros on the network's device, in `kind`, for the
    /// residues of `features`.
    fn first_recycled(&self, features: &Features, kind: Kind, exec: &Exec) -> Result<Recycled> {
        // The residue mask alone, not a whole slice converted to `kind`.
        let first = features.iteration(0).map_err(|e| crate::model::Error::Invalid(format!("features: {e}")))?;
        let seq_mask = first.seq_mask.f_squeeze_dim(0)?.f_to_kind(kind)?.f_to_device(self.device)?;
        Recycled::zeros(&PairRows::for_pass(exec, seq_mask.size()[0]), &self.config, &seq_mask)
    }

    /// Inference over `recycling`'s schedule: passes `0..=max` over slices of `features`, each
    /// from the previous one's outputs, stopping after a pass `r > 0` whose CA distance change
    /// from the pass before ([`recycling::ca_distance_change`]) is below the tolerance (as
    /// ColabFold does). Returns the last pass and the recycles run (passes less one). Every
    /// pass keeps its autograd graph unless the caller runs under `tch::no_grad`. Under DAP
    /// every rank holds the same gathered positions, so every rank stops at the same pass.
    pub fn predict_recycling(
        &self,
        features: &Features,
        recycling: Recycling,
        kind: Kind,
        exec: &Exec,
    ) -> Result<(Pass, usize)> {
        let available = features.num_iterations();
        ensure!(
            (recycling.max as i64) < available,
            "{} recycles need {} feature slices, the features have {available}",
            recycling.max,
            recycling.max + 1
        );
        let mut prev = self.first_recycled(features, kind, exec)?;
        let residues = prev.msa_first_row.size()[0];
        let mut prev_positions = Tensor::f_zeros([residues, 37, 3], (Kind::Float, self.device))?;
        let mut r = 0;
        loop {
            let batch = self.batch(features, r as i64, kind)?;
            let pass = self.pass(&batch, prev, exec, None)?;
            let settled = r > 0
                && recycling::ca_distance_change(&prev_positions, &pass.structure.atom37, &batch.seq_mask)?
                    < recycling.early_stop_tolerance;
            if r == recycling.max || settled {
                return Ok((pass, r));
            }
            prev_positions = pass.structure.atom37.shallow_clone();
            prev = pass.recycled;
            r += 1;
        }
    }
}

/// The keys one monomer training pass drops with, from the pass's key.
#[derive(Clone, Copy, Debug)]
pub struct PassKeys {
    /// The extra-MSA stack's chain, which the Evoformer continues.
    pub stacks: Key,
    /// The template pair stack's.
    pub templates: Key,
    /// The structure module's.
    pub structure: Key,
}

/// A monomer pass's keys: its key split in three (the stacks', the templates', the structure
/// module's), a derivation of this implementation (see the module docs).
pub fn pass_keys(key: Key) -> PassKeys {
    let k = key.split(3);
    PassKeys { stacks: k[0], templates: k[1], structure: k[2] }
}
